"""The HTTP server: OpenAI-compatible and llama.cpp-style routes over the continuous-batching scheduler."""
