"""The KV cache: block allocator with the prefix index, the block pool, block tables."""
