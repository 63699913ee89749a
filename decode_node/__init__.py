"""The decode process: admits handed-off requests into a continuously batched decode loop."""
