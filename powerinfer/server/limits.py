"""What one client may take of the server, and the defaults (docs/serving.md, "Limits and timeouts"):
one definition for create_app, the connection protocol and `serve`'s flags, which read it without
loading the server (this module imports nothing)."""

DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, then again for its body
DEFAULT_KEEP_ALIVE = 5.0  # uvicorn's own default
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_BODY_SIZE = 8 * 1024 * 1024
DEFAULT_MAX_BODY_MEMORY = 64 * 1024 * 1024  # all the request bodies being read at once
DEFAULT_MAX_EMBEDDING_TOKENS = 32768  # per /v1/embeddings request, all its inputs together
DEFAULT_WATCHDOG_SECONDS = 120.0  # a prefill of a long prompt on a large model is one step
