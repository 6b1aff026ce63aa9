"""The held-out files (never trained on), read back for evaluation.

The held-out set comes in parts, one for each corpus build: `heldout` (the original part: Python,
JavaScript, TypeScript) and `heldout-debian` (Go, Rust, Ruby, JavaScript, C and C++ headers from
Debian packages). Each part's list, `engine/train/data/<part>.txt`, names its files as
`sha256 lang id`, sorted by content hash. The text comes from the part's built file
(`.corpus/<part>.jsonl`) when it exists, else from the installed sources the id names (the
standard library, an installed package, `.corpus/npm`, or the packages `engine.train.fetch_debian`
unpacked into `.corpus/debian/site`). A file whose content changed (another version installed) is
skipped unless `allow_changed` is set.

A file's language is the one its suffix names (engine/train/corpus.py's LANG_BY_SUFFIX, which
built the lists' `lang` column the same way).
"""

from __future__ import annotations

import hashlib
import heapq
import importlib.metadata as md
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .corpus import LANG_BY_SUFFIX

DATA_DIR = Path(__file__).parent / "data"
ORIGINAL = "heldout"  # the part every number before the Debian part was measured on
HELDOUT_LIST = DATA_DIR / f"{ORIGINAL}.txt"


@dataclass(frozen=True)
class Part:
    name: str
    listing: Path  # `sha256 lang id` lines, sorted by content hash
    built: Path  # the corpus build's JSON lines ({"id", "lang", "text"}); may be absent


def part(spec: str | Path, corpus: Path = Path(".corpus")) -> Part:
    """A part by its built file (`.corpus/heldout-debian.jsonl`) or its name (`heldout-debian`);
    its list is `engine/train/data/<name>.txt`."""
    path = Path(spec)
    if path.suffix == ".jsonl":
        name, built = path.stem, path
    else:
        name, built = str(spec), corpus / f"{spec}.jsonl"
    listing = DATA_DIR / f"{name}.txt"
    if not listing.is_file():
        raise ValueError(f"no held-out list {listing.name} in {DATA_DIR} for {spec}")
    return Part(name, listing, built)


def language(doc_id: str, listed: str | None = None) -> str:
    """The language a file's suffix names; `listed` (the list's column) for an unknown suffix."""
    return LANG_BY_SUFFIX.get(Path(doc_id).suffix) or listed or ""


def entries(lang: str | None = None, listing: Path | None = None) -> list[tuple[str, str, str]]:
    """(sha256, lang, id) of a part's list (default: the original part's), in its order."""
    listing = listing or HELDOUT_LIST
    rows = [line.split(" ", 2) for line in listing.read_text().splitlines() if line.strip()]
    return [(sha, lg, doc_id) for sha, lg, doc_id in rows if lang is None or lg == lang]


def _resolve(doc_id: str, corpus: Path) -> Path | None:
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
        return corpus / "npm" / "node_modules" / name / rel
    if kind == "debian":
        return corpus / "debian" / "site" / name / rel
    return None


def _texts(built: Path) -> dict[str, str]:
    if not built.exists():
        return {}
    with open(built) as f:
        return {d["id"]: d["text"] for d in map(json.loads, f)}


def _read(
    sha: str, doc_id: str, texts: dict[str, str], corpus: Path, allow_changed: bool
) -> str | None:
    text = texts.get(doc_id)
    if text is None:
        path = _resolve(doc_id, corpus)
        if path is None or not path.is_file():
            return None
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    if hashlib.sha256(text.encode()).hexdigest() != sha and not allow_changed:
        return None
    return text


def load(
    lang: str | None = "python",
    corpus: Path = Path(".corpus"),
    allow_changed: bool = False,
    limit: int | None = None,
) -> list[tuple[str, str]]:
    """[(id, text)] of the original part in the list's order (sorted by content hash: a fixed
    pseudo-random order)."""
    texts = _texts(corpus / "heldout.jsonl")
    out = []
    for sha, _, doc_id in entries(lang):
        text = _read(sha, doc_id, texts, corpus, allow_changed)
        if text is None:
            continue
        out.append((doc_id, text))
        if limit and len(out) >= limit:
            break
    return out


def load_parts(
    parts: list[Part],
    languages: set[str] | None = None,
    corpus: Path = Path(".corpus"),
    allow_changed: bool = False,
    per_language: int | None = None,
) -> list[tuple[str, str]]:
    """[(id, text)] of the given parts' files in `languages` (all when None), the first
    `per_language` of each language, in content-hash order over the parts together (each list's
    own order, merged), so no part's files come first because of where it was given. A file
    listed twice (by id or content) counts once, from the first part that lists it. With the
    original part alone and one language, the files `load(lang, limit=per_language)` gives."""
    lists = [
        [(sha, rank, lg, doc_id) for sha, lg, doc_id in entries(None, p.listing)]
        for rank, p in enumerate(parts)
    ]
    texts: dict[int, dict[str, str]] = {}
    seen_ids: set[str] = set()
    seen_shas: set[str] = set()
    taken: dict[str, int] = {}
    out = []
    # Merged by hash; each list keeps its own order, and equal hashes come in the parts' order.
    for sha, rank, listed, doc_id in heapq.merge(*lists, key=lambda row: row[0]):
        lang = language(doc_id, listed)
        if languages is not None and lang not in languages:
            continue
        if per_language and taken.get(lang, 0) >= per_language:
            continue
        if doc_id in seen_ids or sha in seen_shas:
            continue
        if rank not in texts:
            texts[rank] = _texts(parts[rank].built)
        text = _read(sha, doc_id, texts[rank], corpus, allow_changed)
        if text is None:
            continue
        seen_ids.add(doc_id)
        seen_shas.add(sha)
        taken[lang] = taken.get(lang, 0) + 1
        out.append((doc_id, text))
    return out
