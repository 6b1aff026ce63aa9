"""wd-lsp: a code-completion language server.

Kept empty on purpose: the server process must start fast and never import torch, so
submodules are imported where they are used.
"""

__version__ = "0.1.0"
