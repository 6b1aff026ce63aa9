"""Exact match by how much of the true line a model can read off its own context.

    python -m engine.train.task_groups DETAILS.jsonl [MORE.jsonl ...] \\
        [--files 300 --tasks-per-file 5]

Rebuilds the single-line tasks an eval cut (the same held-out files, seed, tasks per file and
context budget: pass what the eval was given) and puts each in one group: a comment or docstring
line; a line all of whose words (identifiers and numbers) occur in the prefix or suffix, Python's
keywords and builtins counting as known; one word that does not; two or more. Prints each group's
share of the tasks and every details file's exact match within it. A model that only copies
well can do no better than its rate on the first groups; the others need knowledge of the code.
"""

from __future__ import annotations

import argparse
import builtins
import keyword
import re
from pathlib import Path

from . import heldout
from .compare import load_details
from .fim_tasks import PREFIX_CHARS, SUFFIX_CHARS, make_tasks

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?")
KNOWN = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls"}
GROUPS = ("all words in context", "one new word", "two or more new words", "comment or docstring")


def context_group(prefix: str, middle: str, suffix: str) -> str:
    """The group of one task (one of GROUPS)."""
    if middle.lstrip().startswith(("#", '"""', "'''")):
        return GROUPS[3]
    seen = set(WORD.findall(prefix)) | set(WORD.findall(suffix))
    new = len(set(WORD.findall(middle)) - seen - KNOWN)
    return GROUPS[min(new, 2)]


def exact_by_group(groups: dict[str, str], details: dict[str, bool]) -> dict[str, tuple[int, int]]:
    """group -> (exact tasks, tasks), over the tasks of `groups` (task id -> group) that `details`
    (task id -> exact) answered."""
    out = {g: (0, 0) for g in GROUPS}
    for task, group in groups.items():
        if task in details:
            hits, n = out[group]
            out[group] = (hits + bool(details[task]), n + 1)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "details", type=Path, nargs="+", help="`eval --details` files of single-line tasks"
    )
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--tasks-per-file", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-chars", type=int, default=PREFIX_CHARS)
    ap.add_argument("--suffix-chars", type=int, default=SUFFIX_CHARS)
    args = ap.parse_args(argv)
    docs = heldout.load("python", limit=args.files)
    tasks = make_tasks(
        docs, "single", args.seed, args.tasks_per_file, args.prefix_chars, args.suffix_chars
    )
    groups = {t.doc_id: context_group(t.prefix, t.middle, t.suffix) for t in tasks}
    runs = []
    for path in args.details:
        rows = {
            task: row for (kind, _, task), row in load_details(path).items() if kind == "single"
        }
        mismatched = sum(
            1 for t in tasks if t.doc_id in rows and rows[t.doc_id]["middle"] != t.middle
        )
        if mismatched:
            raise SystemExit(
                f"{path}: {mismatched} tasks differ from the ones rebuilt here (other --files, "
                "--tasks-per-file or --seed?)"
            )
        runs.append((path.name, exact_by_group(groups, {k: r["exact"] for k, r in rows.items()})))
    print(f"{len(tasks)} single-line tasks")
    for group in GROUPS:
        n = sum(1 for g in groups.values() if g == group)
        cells = "  ".join(
            f"{name}: {100 * h / max(c, 1):.1f}%" for name, by in runs for h, c in [by[group]]
        )
        print(f"{group:24s} {n:5d} ({100 * n / max(len(tasks), 1):4.1f}%)  {cells}")


if __name__ == "__main__":
    main()
