"""`wd-lsp bench`: replay real typing through the real language server and engine daemon.

A source file is typed key by key (`script`) by a simulated editor (`editors`: VS Code or
Neovim 0.12 request habits) talking LSP over stdio (`lsp_client`) to the server run with a thin
probe (`probe_server`) that timestamps each engine answer. `compare` runs the cache modes side
by side, `soak` many editors at once; `metrics` and `report` turn the records into JSON,
markdown and plots. Nothing here imports torch.
"""
