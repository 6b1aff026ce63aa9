"""The engine's wire protocol, client and private paths; torch-free, so the server imports it."""
