"""The KV cache: what the model asks of it (cache), block allocator with the prefix index, the
block pool and its per-forward view, block tables, and a plain contiguous cache."""
