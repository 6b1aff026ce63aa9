"""The engine's fronts: the daemon on the private socket and the OpenAI-compatible endpoint."""
