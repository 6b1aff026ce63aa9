"""The server process must stay light: no module of `wd_lsp` (the latency suite included) nor of
the engine's ipc package imports torch, Triton, numpy or transformers.

The modules are found by walking the source tree, so a new module is covered without a list to
keep up. They are imported one by one in a fresh interpreter, which names the first module that
pulls a heavy package in.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("wd_lsp", "engine/ipc")
HEAVY = ("torch", "triton", "numpy", "transformers")


def torch_free_modules() -> list[str]:
    """Every module of the torch-free packages, a package before its modules."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(parts))
    return sorted(names, key=lambda name: (name.count("."), name))


CHECK = """
import sys
heavy = {heavy!r}
for name in {modules!r}:
    __import__(name)
    pulled = [m for m in heavy if m in sys.modules]
    assert not pulled, f"importing {{name}} imported {{pulled}}"
# Building a context at run time loads tree-sitter grammars: still nothing heavy.
from wd_lsp.document import Document, Position
from wd_lsp.context import build_context
build_context(Document("file:///a.py", "def f():\\n    return 1\\n", "python"), Position(1, 4))
pulled = [m for m in heavy if m in sys.modules]
assert not pulled, f"building a context imported {{pulled}}"
"""


def test_the_walk_finds_the_modules_that_must_stay_light():
    modules = torch_free_modules()
    for name in (
        "wd_lsp",
        "wd_lsp.server",
        "wd_lsp.engine_link",
        "wd_lsp.config",
        "wd_lsp.openai_backend",
        "wd_lsp.bench.cli",
        "wd_lsp.bench.__main__",
        "engine.ipc",
        "engine.ipc.protocol",
        "engine.ipc.client",
    ):
        assert name in modules, name
    assert not [m for m in modules if not m.startswith(("wd_lsp", "engine.ipc"))]


def test_no_torch_import():
    code = CHECK.format(heavy=HEAVY, modules=torch_free_modules())
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
