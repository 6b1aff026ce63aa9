"""Compare two models task by task on the same evaluation tasks (two `eval --details` files).

    python -m engine.train.compare OLD.jsonl NEW.jsonl

Both models answer the same tasks, so the fair test of "is the new one better" looks only at
the tasks where they differ: McNemar's exact test on the discordant pairs (tasks exact only with
one of the two). Prints the counts, each model's exact match and edit similarity on the shared
tasks, and the two-sided p-value: over all tasks, and per language (`languages`) where the rows
name theirs (`eval --details` does) and there is more than one. A retrain that helps one language
and hurts another shows there, not in the pooled test.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .metrics import edit_similarity


def load_details(path: Path) -> dict[tuple[str, str, str], dict]:
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["kind"], row["order"], row["task"])] = row
    return rows


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: under 'no difference' each discordant task is a fair
    coin, so the smaller count is binomial(n, 1/2); the tail is doubled and capped at 1."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(old: dict, new: dict) -> dict:
    shared = sorted(old.keys() & new.keys())
    if not shared:
        raise SystemExit("the two files share no task (same --files, --seed, --tasks-per-file?)")
    result = {**_compare_on(old, new, shared), "only_in_one_file": len(old.keys() ^ new.keys())}
    by_language: dict[str, list] = {}
    for key in shared:
        by_language.setdefault(new[key].get("lang") or old[key].get("lang") or "?", []).append(key)
    if len(by_language) > 1:
        result["languages"] = {
            lang: _compare_on(old, new, keys) for lang, keys in sorted(by_language.items())
        }
    return result


def _compare_on(old: dict, new: dict, shared: list) -> dict:
    only_old = sum(old[k]["exact"] and not new[k]["exact"] for k in shared)
    only_new = sum(new[k]["exact"] and not old[k]["exact"] for k in shared)
    both = sum(old[k]["exact"] and new[k]["exact"] for k in shared)
    n = len(shared)

    def summary(rows):
        return {
            "exact_match": round(sum(rows[k]["exact"] for k in shared) / n, 4),
            "edit_similarity": round(
                sum(edit_similarity(rows[k]["pred"], rows[k]["middle"]) for k in shared) / n, 4
            ),
            "empty": sum(not rows[k]["pred"].strip() for k in shared),
        }

    return {
        "tasks": n,
        "both_exact": both,
        "only_old_exact": only_old,
        "only_new_exact": only_new,
        "mcnemar_p": round(mcnemar_exact(only_old, only_new), 4),
        "old": summary(old),
        "new": summary(new),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args(argv)
    print(json.dumps(compare(load_details(args.old), load_details(args.new)), indent=1))


if __name__ == "__main__":
    main()
