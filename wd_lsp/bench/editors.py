"""How editors ask for inline completions while the user types.

- VS Code: a request on every keystroke; the previous one, if still open, is cancelled
  (`$/cancelRequest`) — its answer would be for text that no longer exists.
- Neovim 0.12 (`vim.lsp.inline_completion`): a request once typing has paused for 200 ms;
  older requests are not cancelled, and an answer for outdated text is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EditorStyle:
    name: str
    debounce_ms: float  # 0: ask on every keystroke
    cancels_previous: bool


EDITORS = {
    "vscode": EditorStyle("vscode", debounce_ms=0.0, cancels_previous=True),
    "nvim": EditorStyle("nvim", debounce_ms=200.0, cancels_previous=False),
}
