"""Completion metrics: exact match (trailing whitespace ignored), edit similarity, and the
confidence interval of a rate measured on a sample of tasks."""

from __future__ import annotations

import math


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


def wilson_interval(hits: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a rate seen as hits / n of independent tasks (Wilson score: sound near 0
    and with few tasks)."""
    if n <= 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def clustered_interval(hits: list[int], tasks: list[int], z: float = 1.96) -> tuple[float, float]:
    """95% interval of a rate over tasks grouped by file (hits[i] of tasks[i] in file i). Tasks
    of one file are not independent, so Wilson's interval is taken at the effective number of
    tasks: n over the design effect, the across-file variance of the rate over the binomial one."""
    n, h, files = sum(tasks), sum(hits), len(tasks)
    if n == 0:
        return 0.0, 1.0
    p = h / n
    if files < 2 or p in (0.0, 1.0):
        return wilson_interval(h, n, z)
    across_files = (
        files / (files - 1) * sum((hi - p * ni) ** 2 for hi, ni in zip(hits, tasks)) / n**2
    )
    design_effect = max(1.0, across_files / (p * (1 - p) / n))
    n_eff = n / design_effect
    return wilson_interval(p * n_eff, n_eff, z)
