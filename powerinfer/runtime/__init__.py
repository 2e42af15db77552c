"""Online machinery: KV cache, sampling, generation, scheduling."""
