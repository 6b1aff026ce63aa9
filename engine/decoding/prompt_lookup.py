"""Prompt-lookup drafts for speculative decoding: guess the next tokens by finding the sequence's
last few tokens earlier in the sequence (prompt and output so far) and copying what followed.

Code repeats itself (identifiers, call patterns, the FIM suffix that the middle runs into), so a
greedy completion often continues as an earlier occurrence did. The engine verifies a draft with
one forward over all its tokens and keeps the prefix that greedy decoding would have produced.
"""

from __future__ import annotations

# Tuned on 200 held-out single-line tasks (their greedy tokens replayed against measured verify
# costs, BENCHMARKS.md): a verify row costs a good part of a decode step on the CPU, so only a
# match of the last 4 tokens predicts well enough to pay; shorter matches (3, 2, 1) cost time.
MAX_DRAFT = 8  # tokens per draft
NGRAM_SIZES = (4,)  # longest match first where several are given


def draft(
    tokens: list[int], max_len: int = MAX_DRAFT, ngram_sizes: tuple[int, ...] = NGRAM_SIZES
) -> list[int]:
    """Up to max_len tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens, for the first n of ngram_sizes that occurs; [] when none does."""
    if max_len <= 0:
        return []
    end = len(tokens)
    for n in ngram_sizes:
        if n >= end:
            continue
        tail = tokens[end - n :]
        last = tail[-1]
        # Scan back from the occurrence ending one before the last token.
        for i in range(end - 2, n - 2, -1):
            if tokens[i] == last and tokens[i - n + 1 : i + 1] == tail:
                return tokens[i + 1 : i + 1 + max_len]
    return []


def writable_prefix(
    proposal: list[int], never: frozenset[int] | set[int], ending: frozenset[int] | set[int]
) -> list[int]:
    """The part of a draft decoding could write: up to (not including) the first token it never
    samples, and up to (including) the first that ends the output. An SPM prompt's prefix runs
    into `<|fim_middle|>`, so a match near the cursor would otherwise draft a control token and
    pay for rows that cannot be accepted."""
    for i, token in enumerate(proposal):
        if token in never:
            return proposal[:i]
        if token in ending:
            return proposal[: i + 1]
    return proposal
