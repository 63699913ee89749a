"""kv: the KV cache as schedulers see it: layout, block allocator, prefix cache, a
sequence's host-side state. Imports base."""
