"""What every pdserve process shares: config, wire protocol, model, KV cache, worker."""
