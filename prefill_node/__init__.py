"""The prefill process: batches prompts, computes their KV and first token, hands them to decode."""
