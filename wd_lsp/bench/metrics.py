"""Figures from replay records: latency percentiles, engine speed, cache and suggestion quality."""

from __future__ import annotations

import math

COUNTERS = ("requests", "engine_calls", "typing_through", "superseded", "empty", "errors", "warms")
ENGINE_COUNTERS = (
    "requests",
    "completed",
    "cancelled",
    "failed",
    "prompt_tokens",
    "cache_hit_tokens",
    "evictions",
)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def spread(values: list[float]) -> dict:
    return dict(
        n=len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        mean=sum(values) / len(values) if values else None,
    )


def would_accept(suggestion: str, truth: str) -> tuple[bool, bool]:
    """(whole, first line): the suggestion is exactly what the user typed next — all of it, or
    its first line up to the end of that line. Trailing whitespace is not held against it."""
    s = suggestion.rstrip()
    if not s:
        return False, False
    whole = truth.startswith(s)
    first = s.split("\n", 1)[0].rstrip()
    truth_line = truth.split("\n", 1)[0].rstrip()
    return whole, bool(first) and first == truth_line


def engine_delta(before: dict, after: dict) -> dict:
    return {k: (after.get(k) or 0) - (before.get(k) or 0) for k in ENGINE_COUNTERS}


def summarize(records: list[dict], server_statuses: list[dict], engine: dict | None = None) -> dict:
    """`records`: RequestRecord.as_dict() rows; `server_statuses`: wdLsp.status of each session
    (a fresh server each, so counters add up); `engine`: the daemon's counter deltas."""
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    shown = [r for r in records if r["outcome"] == "shown"]
    answered = [r for r in records if r["outcome"] in ("shown", "empty")]
    first = [
        r["first_token_ms"]
        for r in records
        if r["first_token_ms"] is not None and r["outcome"] != "cancelled"
    ]
    usage = [r["usage"] for r in records if r.get("usage")]
    decoded = [r for r in records if r.get("decode_s") and r.get("deltas", 0) > 1]
    decode_s = sum(r["decode_s"] for r in decoded)
    accept = [would_accept(r["text"], r["truth"]) for r in shown]
    prompt = sum(u.get("prompt_tokens", 0) for u in usage)
    server = {k: sum((s.get(k) or 0) for s in server_statuses) for k in COUNTERS}
    summary = dict(
        requests=len(records),
        outcomes=outcomes,
        keystroke_to_ghost_ms=spread([r["ghost_ms"] for r in shown]),
        keystroke_to_answer_ms=spread([r["ghost_ms"] for r in answered]),
        keystroke_to_first_token_ms=spread(first),
        request_to_first_token_ms=spread(
            [
                r["request_first_token_ms"]
                for r in records
                if r["request_first_token_ms"] is not None and r["outcome"] != "cancelled"
            ]
        ),
        # The server's engine call -> first streamed token (queue, prefill, first decode step).
        engine_first_token_ms=spread(
            [
                r["engine_first_token_ms"]
                for r in records
                if r.get("engine_first_token_ms") is not None
            ]
        ),
        decode_tokens_per_s=(sum(r["deltas"] - 1 for r in decoded) / decode_s)
        if decode_s > 0
        else None,
        # Completions the engine finished itself (a server stop rule cuts the rest short).
        cache_hit_ratio=(sum(u.get("cached_tokens", 0) for u in usage) / prompt)
        if prompt
        else None,
        typing_through=server["typing_through"],
        would_accept_whole=(sum(a[0] for a in accept) / len(accept)) if accept else None,
        would_accept_first_line=(sum(a[1] for a in accept) / len(accept)) if accept else None,
        shown=len(shown),
        cancelled=outcomes.get("cancelled", 0),
        superseded=server["superseded"],
        errors=outcomes.get("error", 0) + server["errors"] + ((engine or {}).get("failed") or 0),
        server=server,
    )
    if engine is not None:
        summary["engine"] = dict(
            engine,
            cache_hit_ratio_all=(engine["cache_hit_tokens"] / engine["prompt_tokens"])
            if engine.get("prompt_tokens")
            else None,
        )
    return summary
