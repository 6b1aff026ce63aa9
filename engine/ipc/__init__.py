"""The engine's wire protocol, client, private paths, token files and socket path; torch-free and
independent of the rest of the engine, so the language server and `wd-engine serve`'s early
checks import it alone."""
