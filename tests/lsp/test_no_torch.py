"""The server process must stay light: importing wd_lsp never imports torch."""

import subprocess
import sys

MODULES = [
    "wd_lsp",
    "wd_lsp.text",
    "wd_lsp.languages",
    "wd_lsp.document",
    "wd_lsp.queries",
    "wd_lsp.symbols",
    "wd_lsp.indent",
    "wd_lsp.context",
    "wd_lsp.shape",
    "wd_lsp.postprocess",
    "wd_lsp.workspace",
    "wd_lsp.__main__",
    "wd_lsp.engine_link",
    "wd_lsp.transport",
    "wd_lsp.server",
    "engine.ipc.client",
    "engine.ipc.paths",
    "engine.ipc.token_files",
]


def test_no_torch_import():
    code = (
        "import sys\n"
        f"for m in {MODULES!r}:\n"
        "    __import__(m)\n"
        "from wd_lsp.document import Document, Position\n"
        "from wd_lsp.context import build_context\n"
        "d = Document('file:///a.py', 'def f():\\n    return 1\\n', 'python')\n"
        "build_context(d, Position(1, 4))\n"
        "heavy = [m for m in ('torch', 'triton', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
