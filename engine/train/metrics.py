"""Completion metrics: exact match (trailing whitespace ignored), edit similarity, and the
confidence intervals of a rate or a mean score measured on a sample of tasks."""

from __future__ import annotations

import functools
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


@functools.cache
def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (q > 0.5) for `df` degrees of freedom: bisection on the CDF, the
    density integrated by Simpson's rule (no statistics library needed)."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi))

    def density(t: float) -> float:
        return scale * (1 + t * t / df) ** (-(df + 1) / 2)

    def cdf(x: float, steps: int = 2000) -> float:
        h = x / steps
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
        return 0.5 + h / 3 * (density(0.0) + inner + density(x))

    low, high = 0.0, 1.0
    while cdf(high) < q:
        low, high = high, 2 * high
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < q else (low, mid)
    return (low + high) / 2


def clustered_mean_interval(sums: list[float], tasks: list[int]) -> tuple[float, float]:
    """95% interval of the mean of per-task scores in [0, 1] (edit similarity) over tasks grouped
    by file (sums[i]: the scores of file i's tasks[i] tasks added up): Student's t interval with
    the across-file standard error and files - 1 degrees of freedom (with one task per file, the
    textbook interval of a mean), cut to [0, 1]. Under two files nothing is known of the spread:
    (0, 1)."""
    n, files = sum(tasks), len(tasks)
    if files < 2 or n == 0:
        return 0.0, 1.0
    mean = sum(sums) / n
    variance = files / (files - 1) * sum((s - mean * t) ** 2 for s, t in zip(sums, tasks)) / n**2
    half = t_quantile(0.975, files - 1) * math.sqrt(variance)
    return max(0.0, mean - half), min(1.0, mean + half)
