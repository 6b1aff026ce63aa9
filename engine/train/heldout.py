"""The held-out files (never trained on), read back for evaluation.

`engine/train/data/heldout.txt` lists them as `sha256 lang id`. The text comes from the built
corpus (`.corpus/heldout.jsonl`) when it exists, else from the installed sources the id names
(the standard library, an installed package, or `.corpus/npm`). A file whose content changed
(another version installed) is skipped unless `allow_changed` is set.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import sysconfig
from pathlib import Path

HELDOUT_LIST = Path(__file__).parent / "data" / "heldout.txt"


def entries(lang: str | None = None) -> list[tuple[str, str, str]]:
    rows = [line.split(" ", 2) for line in HELDOUT_LIST.read_text().splitlines() if line.strip()]
    return [(sha, lg, doc_id) for sha, lg, doc_id in rows if lang is None or lg == lang]


def _resolve(doc_id: str, npm_root: Path) -> Path | None:
    kind, _, rest = doc_id.partition(":")
    if kind == "python-stdlib":
        return Path(sysconfig.get_paths()["stdlib"]) / rest
    name, _, rel = rest.partition(":")
    if kind == "pypi":
        try:
            return Path(md.distribution(name).locate_file(rel))
        except md.PackageNotFoundError:
            return None
    if kind == "npm":
        return npm_root / "node_modules" / name / rel
    return None


def load(
    lang: str | None = "python",
    corpus: Path = Path(".corpus"),
    allow_changed: bool = False,
    limit: int | None = None,
) -> list[tuple[str, str]]:
    """[(id, text)] in the list's order (sorted by content hash: a fixed pseudo-random order)."""
    wanted = entries(lang)
    built = corpus / "heldout.jsonl"
    texts: dict[str, str] = {}
    if built.exists():
        with open(built) as f:
            texts = {d["id"]: d["text"] for d in map(json.loads, f)}
    out = []
    for sha, _, doc_id in wanted:
        text = texts.get(doc_id)
        if text is None:
            path = _resolve(doc_id, corpus / "npm")
            if path is None or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        if hashlib.sha256(text.encode()).hexdigest() != sha and not allow_changed:
            continue
        out.append((doc_id, text))
        if limit and len(out) >= limit:
            break
    return out
