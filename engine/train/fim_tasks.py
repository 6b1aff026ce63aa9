"""Seeded FIM evaluation tasks cut from held-out files.

single-line: one random line; its indentation stays in the prefix (the editor has already
             indented), the middle is the rest of the line, the suffix starts at its newline.
multi-line:  2-5 consecutive lines starting at a random line, cut the same way (never ending on
             blank lines).
Where a task may start depends on the file's language (from its suffix, as heldout.language):
- Python, and text of no known language: any non-empty line, the rule of every number since the
  first model (so Python's tasks stay those tasks).
- every other language: a line with a letter, digit or underscore, and not Ruby's bare `end`.
  Lines that only close a block (`}`, `});`, `)`, `*/`, `end`) are a fifth of the lines of the
  brace languages and a seventh of Ruby's `end` alone, against a sixteenth in Python; nearly free
  to predict (and closed by the editor itself), they would flatter those languages' numbers.
  Blocks are cut by lines in every language (tab or space indentation alike), so a multi-line
  middle may close or open braces as a Python one may dedent.
Prefix and suffix are trimmed at line boundaries to a character budget: by default 2,000 and
1,000, which keeps prompts inside a 1024-token context (the eval's numbers since the first model);
`eval --prefix-chars/--suffix-chars` give as much as the language server sends.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .heldout import language

PREFIX_CHARS, SUFFIX_CHARS = 2000, 1000
# Languages whose tasks may start at any non-empty line ("": no known language).
ANY_LINE = {"python", ""}
WORD = re.compile(r"\w")
RUBY_END = re.compile(r"end\W*")


def starts_task(line: str, lang: str) -> bool:
    """Whether a task in `lang` may start at `line` (see the module's docstring)."""
    code = line.strip()
    if lang in ANY_LINE:
        return bool(code)
    if not WORD.search(code):
        return False
    return not (lang == "ruby" and RUBY_END.fullmatch(code))


@dataclass
class FimTask:
    doc_id: str
    kind: str  # "single" | "multi"
    prefix: str
    middle: str
    suffix: str
    file: str = ""  # the file it was cut from (doc_id names the task), for intervals over files
    lang: str = ""  # the file's language (from its suffix; "" when unknown)


def _trim(prefix: str, suffix: str, prefix_chars: int, suffix_chars: int) -> tuple[str, str]:
    if len(prefix) > prefix_chars:
        cut = prefix.find("\n", len(prefix) - prefix_chars)
        prefix = prefix[cut + 1 :] if cut != -1 else prefix[-prefix_chars:]
    if len(suffix) > suffix_chars:
        cut = suffix.rfind("\n", 0, suffix_chars)
        suffix = suffix[: cut + 1] if cut > 0 else suffix[:suffix_chars]
    return prefix, suffix


def make_task(
    doc_id: str,
    text: str,
    kind: str,
    rng: random.Random,
    taken: set[int] | None = None,
    file: str | None = None,
    prefix_chars: int = PREFIX_CHARS,
    suffix_chars: int = SUFFIX_CHARS,
    lang: str | None = None,
) -> FimTask | None:
    """One task from a random line of `text` where a task may start in `lang` (default: the
    language of `file`'s suffix); `taken`: lines already used as a first line (skipped, and the
    chosen one added); `file`: where it comes from (default doc_id)."""
    file = file or doc_id
    lang = language(file) if lang is None else lang
    lines = text.split("\n")
    candidates = [i for i, l in enumerate(lines) if starts_task(l, lang)]
    if taken:
        candidates = [i for i in candidates if i not in taken]
    if not candidates:
        return None
    first = rng.choice(candidates)
    if taken is not None:
        taken.add(first)
    n = 1 if kind == "single" else rng.randint(2, 5)
    last = min(len(lines) - 1, first + n - 1)
    while last > first and not lines[last].strip():  # never end a block on blank lines
        last -= 1
    start = sum(len(l) + 1 for l in lines[:first])
    start += len(lines[first]) - len(lines[first].lstrip(" \t"))
    end = sum(len(l) + 1 for l in lines[: last + 1]) - 1
    prefix, suffix = _trim(text[:start], text[end:], prefix_chars, suffix_chars)
    return FimTask(doc_id, kind, prefix, text[start:end], suffix, file, lang)


def make_tasks(
    docs: list[tuple[str, str]],
    kind: str,
    seed: int = 0,
    per_file: int = 1,
    prefix_chars: int = PREFIX_CHARS,
    suffix_chars: int = SUFFIX_CHARS,
) -> list[FimTask]:
    """Up to `per_file` tasks from each file, at distinct first lines. The first task of a file is
    the same whatever `per_file` is, so results with 1 stay comparable with earlier ones."""
    tasks = []
    for doc_id, text in docs:
        rng = random.Random(f"{seed}:{kind}:{doc_id}")  # per file, so subsets give the same tasks
        taken: set[int] = set()
        for k in range(per_file):
            task = make_task(
                doc_id if k == 0 else f"{doc_id}#{k}",
                text,
                kind,
                rng,
                taken,
                file=doc_id,
                prefix_chars=prefix_chars,
                suffix_chars=suffix_chars,
            )
            if task is None:
                break
            tasks.append(task)
    return tasks
