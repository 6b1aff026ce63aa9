"""Completion metrics: exact match (trailing whitespace ignored) and edit similarity."""
from __future__ import annotations


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def normalize(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.rstrip().split("\n"))


def exact_match(pred: str, target: str) -> bool:
    return normalize(pred) == normalize(target)


def edit_similarity(pred: str, target: str) -> float:
    """1 - Levenshtein / longer length, on whitespace-normalized text (1.0 = identical)."""
    p, t = normalize(pred), normalize(target)
    if not p and not t:
        return 1.0
    return 1.0 - levenshtein(p, t) / max(len(p), len(t))
