"""The engine's fronts over one completion service (service.py): the daemon on the private socket
(daemon.py) and the OpenAI-compatible endpoint (openai_http.py), which never import each other."""
