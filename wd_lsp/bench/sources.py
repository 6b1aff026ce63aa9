"""Real files to type: the default model's held-out Python files (never trained on, read from the
installed standard library and packages), then this project's own Python files."""

from __future__ import annotations

import random
from pathlib import Path

from .script import Segment, pick_segment

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROJECT_DIRS = ("wd_lsp", "engine", "kernels")


def heldout_files(limit: int | None = None) -> list[tuple[str, str]]:
    try:
        from engine.train import heldout  # stdlib only; absent from a trimmed install
    except ImportError:
        return []
    return heldout.load("python", corpus=PROJECT_ROOT / ".corpus", limit=limit)


def project_files() -> list[tuple[str, str]]:
    out = []
    for folder in PROJECT_DIRS:
        for path in sorted((PROJECT_ROOT / folder).rglob("*.py")):
            if path.stat().st_size > 2000:
                out.append(
                    (
                        str(path.relative_to(PROJECT_ROOT)),
                        path.read_text(encoding="utf-8", errors="replace"),
                    )
                )
    return out


def load(source: str) -> list[tuple[str, str]]:
    """`heldout`, `project`, `all`, or a list of file paths separated by commas."""
    if source == "heldout":
        return heldout_files()
    if source == "project":
        return project_files()
    if source == "all":
        return heldout_files() + project_files()
    return [
        (p, Path(p).read_text(encoding="utf-8", errors="replace")) for p in source.split(",") if p
    ]


# Enough text on both sides to fill the server's default prompt budget (1536 prefix tokens and
# 512 suffix tokens at ~3.5 chars a token): the size where a cold prompt costs the most.
MIN_BEFORE_CHARS = 6000
MIN_AFTER_CHARS = 2000


def segments(
    files: list[tuple[str, str]],
    count: int,
    lines: int,
    seed: int,
    min_before: int = MIN_BEFORE_CHARS,
    min_after: int = MIN_AFTER_CHARS,
) -> list[Segment]:
    """`count` segments, each from a different file (so no replay warms the cache of another),
    drawn in a seeded random order."""
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    out = []
    for name, text in order:
        segment = pick_segment(_safe_name(name, len(out)), text, lines, rng, min_before, min_after)
        if segment is not None:
            out.append(segment)
        if len(out) == count:
            break
    return out


def _safe_name(name: str, n: int) -> str:
    stem = name.replace(":", "/").rsplit("/", 1)[-1]
    return f"{n:02d}_{stem}" if stem.endswith(".py") else f"{n:02d}_{stem}.py"
