"""The resident inference engine: model loading, forward pass, KV cache, generation."""
