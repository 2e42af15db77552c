"""One module per CLI command, each with `main(args) -> int`."""
