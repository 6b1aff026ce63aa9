"""The packages' layering, read from the source with `ast` (nothing is imported, so no import
side effect hides or adds an arrow; imports inside functions count like any other):

- `engine/` and `kernels/` never import `wd_lsp` (the language server sits on top);
- `kernels/` imports nothing from `engine/` or `wd_lsp/` (pure compute);
- `engine/ipc` imports no other engine package and no torch (the server imports it);
- library modules never import benchmarks (`engine.bench`, `kernels.bench`) or training
  (`engine.train`);
- `wd_lsp` (its benchmarks aside) takes from the engine only `engine.ipc`, and never imports
  torch, Triton, numpy or transformers;
- the engine's packages import each other without a cycle, and so do its modules (imports
  under `if TYPE_CHECKING:` aside: they never run).

Each rule is also run on a small made-up tree that breaks it, to show that it would fail.

`python -m tests.test_layering` prints the package import graph, one edge a line.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "wd_lsp")
HEAVY = ("torch", "triton", "numpy", "transformers")
# Outside the library: what a library module must never import.
BENCH_AND_TRAIN = ("engine.bench", "kernels.bench", "engine.train")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted and absolute
    path: str  # the importing file, relative to the tree's root
    line: int
    type_only: bool = False  # under `if TYPE_CHECKING:`: for the type checker, never run

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree_modules(root: Path) -> frozenset[str]:
    return frozenset(_module_name(p, root) for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


@functools.cache
def _first_party_modules() -> frozenset[str]:
    return _tree_modules(ROOT)


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _type_only_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes under an `if TYPE_CHECKING:` (not its else)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve_from(source: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute module a `from ... import` names (PEP 328 rules for relative imports)."""
    if level == 0:
        return module or ""
    base = source.split(".")
    base = base if is_package else base[:-1]  # a module's own package is level 1
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_in_source(
    text: str,
    source: str,
    is_package: bool = False,
    path: str = "<source>",
    modules: frozenset[str] | None = None,
) -> list[Import]:
    """Every import in `text` (module `source`), at any depth, as absolute module names.

    `from a import b` names the module a.b when that module exists in the tree (`modules`, by
    default the project's), else a; a call `importlib.import_module("a.b")` with a literal name
    counts too. Imports under `if TYPE_CHECKING:` are marked `type_only`.
    """
    modules = _first_party_modules() if modules is None else modules
    tree = ast.parse(text)
    type_only = _type_only_nodes(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve_from(source, is_package, node.module, node.level)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.append(sub if sub in modules else module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            targets = [node.args[0].value]
        found += [
            Import(source, t, path, node.lineno, id(node) in type_only)
            for t in dict.fromkeys(targets)
        ]
    return found


def tree_imports(root: Path) -> tuple[Import, ...]:
    """Every import of every module of the packages (engine, kernels, wd_lsp) under `root`."""
    modules = _tree_modules(root)
    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            found += imports_in_source(
                path.read_text(encoding="utf-8"),
                _module_name(path, root),
                path.name == "__init__.py",
                str(path.relative_to(root)),
                modules,
            )
    return tuple(found)


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """Every import of every first-party module of the project."""
    return tree_imports(ROOT)


def package_of(module: str) -> str | None:
    """The node of the package graph a module belongs to: `engine.<part>` (a subpackage or a
    top-level module such as engine.cli), `kernels` / `kernels.bench`, `wd_lsp` / `wd_lsp.bench`;
    None for modules outside the project."""
    parts = module.split(".")
    if parts[0] == "engine":
        return ".".join(parts[:2])
    if parts[0] in ("kernels", "wd_lsp"):
        return ".".join(parts[:2]) if parts[1:2] == ["bench"] else parts[0]
    return None


def package_graph(imports=None) -> Counter[tuple[str, str]]:
    """(importing package, imported package) -> number of import statements between them."""
    edges = Counter()
    for imp in all_imports() if imports is None else imports:
        src, dst = package_of(imp.source), package_of(imp.target)
        if src and dst and src != dst:
            edges[src, dst] += 1
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle of the directed graph `edges` as [a, b, ..., a], or None."""
    succ: dict[str, list[str]] = {}
    for src, dst in sorted(edges):
        succ.setdefault(src, []).append(dst)
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in succ.get(node, ()):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(succ):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def tangles(edges) -> list[set[str]]:
    """The groups of two or more nodes that reach each other (strongly connected components)."""
    succ: dict[str, set[str]] = {}
    for src, dst in edges:
        succ.setdefault(src, set()).add(dst)

    @functools.cache
    def reach(node: str) -> frozenset[str]:
        seen, todo = set(), [node]
        while todo:
            for nxt in succ.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    groups = []
    for node in sorted(succ):
        group = {node} | {other for other in reach(node) if node in reach(other)}
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return groups


def _violations(where, forbidden, imports=None) -> list[str]:
    imports = all_imports() if imports is None else imports
    return [str(imp) for imp in imports if where(imp.source) and forbidden(imp.target)]


def wd_lsp_violations(imports) -> list[str]:
    """Imports of the language server (its benchmarks aside) that take from the engine anything
    but `engine.ipc`, or load a heavy package, at any depth."""
    return _violations(
        lambda src: _within(src, "wd_lsp") and not _within(src, "wd_lsp.bench"),
        lambda dst: (
            (_within(dst, "engine") and not _within(dst, "engine.ipc"))
            or any(_within(dst, heavy) for heavy in HEAVY)
        ),
        imports,
    )


def module_cycles(imports) -> list[str]:
    """The groups of engine modules that import each other, each with the imports that tie it:
    imports at any depth count (a function's import runs when it is called), those under
    `if TYPE_CHECKING:` do not (they never run)."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if (
            not imp.type_only
            and imp.source != imp.target
            and _within(imp.source, "engine")
            and _within(imp.target, "engine")
        ):
            edges.setdefault((imp.source, imp.target), []).append(imp)
    found = []
    for group in tangles(edges):
        ties = [
            str(imp) for (a, b), imps in sorted(edges.items()) if {a, b} <= group for imp in imps
        ]
        found.append(", ".join(sorted(group)) + ":\n    " + "\n    ".join(ties))
    return found


def _report(violations: list[str]) -> str:
    return "\n" + "\n".join(violations)


# --- the rules ------------------------------------------------------------------------------


def test_engine_and_kernels_never_import_wd_lsp():
    bad = _violations(
        lambda src: _within(src, "engine") or _within(src, "kernels"),
        lambda dst: _within(dst, "wd_lsp"),
    )
    assert not bad, _report(bad)


def test_kernels_import_nothing_from_engine_or_wd_lsp():
    bad = _violations(
        lambda src: _within(src, "kernels"),
        lambda dst: _within(dst, "engine") or _within(dst, "wd_lsp"),
    )
    assert not bad, _report(bad)


def test_ipc_imports_no_other_engine_package_and_no_torch():
    bad = _violations(
        lambda src: _within(src, "engine.ipc"),
        lambda dst: (
            (_within(dst, "engine") and not _within(dst, "engine.ipc"))
            or any(_within(dst, heavy) for heavy in HEAVY)
        ),
    )
    assert not bad, _report(bad)


def _is_library(module: str) -> bool:
    return (_within(module, "engine") or _within(module, "kernels")) and not any(
        _within(module, outside) for outside in BENCH_AND_TRAIN
    )


def test_library_modules_never_import_benchmarks_or_training():
    bad = _violations(
        _is_library, lambda dst: any(_within(dst, outside) for outside in BENCH_AND_TRAIN)
    )
    assert not bad, _report(bad)


def _engine_library_edges() -> dict[tuple[str, str], list[Import]]:
    """Arrows between the engine's library packages (model, loading, kv, core, decoding,
    prompts, ipc, serve, cli, ...), each with the imports that make it."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in all_imports():
        src, dst = package_of(imp.source), package_of(imp.target)
        if (
            src != dst
            and src is not None
            and dst is not None
            and src.startswith("engine.")
            and dst.startswith("engine.")
            and _is_library(src)
            and _is_library(dst)
        ):
            edges.setdefault((src, dst), []).append(imp)
    return edges


def test_engine_packages_form_no_cycle():
    edges = _engine_library_edges()
    cycle = find_cycle(edges)
    if cycle:
        steps = [
            f"  {a} -> {b}: " + "; ".join(str(imp) for imp in edges[a, b][:3])
            for a, b in zip(cycle, cycle[1:])
        ]
        groups = "; ".join(", ".join(sorted(group)) for group in tangles(edges))
        raise AssertionError(
            "import cycle "
            + " -> ".join(cycle)
            + "\n"
            + "\n".join(steps)
            + f"\npackages that reach each other: {groups}"
        )


def test_wd_lsp_takes_only_ipc_from_the_engine_and_nothing_heavy():
    bad = wd_lsp_violations(all_imports())
    assert not bad, _report(bad)


def test_engine_modules_form_no_cycle():
    cycles = module_cycles(all_imports())
    assert not cycles, "modules that import each other:\n" + "\n".join(cycles)


# --- the checks, shown to fail on a tree that breaks them -----------------------------------


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_wd_lsp_rule_fails_on_an_engine_or_heavy_import(tmp_path):
    imports = tree_imports(
        _write_tree(
            tmp_path,
            {
                "engine/__init__.py": "",
                "engine/ipc/__init__.py": "",
                "engine/ipc/protocol.py": "",
                "engine/core/__init__.py": "",
                "engine/core/request.py": "",
                "wd_lsp/__init__.py": "from engine.ipc.protocol import ErrorCode\n",
                "wd_lsp/link.py": (
                    "from engine.ipc import protocol\n"
                    "def f():\n"
                    "    from engine.core.request import Request\n"
                    "    import numpy.linalg\n"
                ),
                "wd_lsp/lazy.py": "class A:\n    def g(self):\n        import torch\n",
                "wd_lsp/bench/__init__.py": "",
                "wd_lsp/bench/eval.py": "import torch\nfrom engine.core import request\n",
            },
        )
    )
    assert sorted(wd_lsp_violations(imports)) == [
        "wd_lsp/lazy.py:3: wd_lsp.lazy imports torch",
        "wd_lsp/link.py:3: wd_lsp.link imports engine.core.request",
        "wd_lsp/link.py:4: wd_lsp.link imports numpy.linalg",
    ]


def test_the_module_cycle_rule_fails_on_a_cycle_and_not_on_a_type_only_one(tmp_path):
    files = {
        "engine/__init__.py": "",
        "engine/a.py": "from engine import b\n",
        "engine/b.py": "def f():\n    from engine.c import C\n",  # a function's import counts
        "engine/c.py": "from .a import A\n",
        "engine/d.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine import e\n"
        ),
        "engine/e.py": (
            "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import engine.d\n"
        ),
    }
    cycles = module_cycles(tree_imports(_write_tree(tmp_path, files)))
    assert len(cycles) == 1 and cycles[0].startswith("engine.a, engine.b, engine.c:"), cycles
    assert "engine/b.py:2: engine.b imports engine.c" in cycles[0]
    # With the type-only arrow (d -> e) a real import too, d and e form a cycle.
    files["engine/d.py"] = "from engine import e\n"
    cycles = module_cycles(tree_imports(_write_tree(tmp_path, files)))
    assert len(cycles) == 2 and cycles[1].startswith("engine.d, engine.e:"), cycles


# --- the reader itself ----------------------------------------------------------------------


def test_the_reader_sees_every_kind_of_import():
    text = (
        "import os, engine.kv.pool\n"
        "from . import layout\n"
        "from ..model import config as c\n"
        "from engine import core\n"
        "def f():\n"
        "    from kernels.bench import gpu_timing\n"
        "    import importlib\n"
        "    return importlib.import_module('engine.train.grow')\n"
        "class A:\n"
        "    if True:\n"
        "        from wd_lsp.text import LineIndex\n"
    )
    found = {imp.target for imp in imports_in_source(text, "engine.prompts.fim")}
    assert found == {
        "os",
        "engine.kv.pool",
        "engine.prompts.layout",
        "engine.model.config",
        "engine.core",
        "kernels.bench.gpu_timing",
        "importlib",
        "engine.train.grow",
        "wd_lsp.text",
    }
    in_package = imports_in_source("from .pool import KVPool\n", "engine.kv", is_package=True)
    assert [imp.target for imp in in_package] == ["engine.kv.pool"]
    typed = imports_in_source(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from engine.kv.pool import KVPool\n"
        "else:\n"
        "    import engine.kv.block_allocator\n",
        "engine.core.state",
    )
    assert {imp.target: imp.type_only for imp in typed} == {
        "typing": False,
        "engine.kv.pool": True,
        "engine.kv.block_allocator": False,
    }


def test_a_cycle_is_found_and_named():
    assert find_cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None
    assert tangles({("a", "b"), ("b", "a"), ("b", "c"), ("c", "d"), ("d", "c")}) == [
        {"a", "b"},
        {"c", "d"},
    ]


def print_package_graph(out=sys.stdout) -> None:
    """The first-party package graph, one edge a line: "engine.core -> engine.model (3 imports)"."""
    for (src, dst), n in sorted(package_graph().items()):
        print(f"{src} -> {dst} ({n} import{'s' if n != 1 else ''})", file=out)
    edges = _engine_library_edges()
    cycle = find_cycle(edges)
    print("engine packages: " + ("cycle " + " -> ".join(cycle) if cycle else "no cycle"), file=out)
    for group in tangles(edges):
        print("  reach each other: " + ", ".join(sorted(group)), file=out)


if __name__ == "__main__":
    print_package_graph()
