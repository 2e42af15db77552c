"""OpenAI-shaped requests and answers, shared by the HTTP server and `LLM.create_completion` / `create_chat_completion`."""
