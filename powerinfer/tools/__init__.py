"""Offline tools: benchmarking, perplexity, quantization, inspection."""
