"""Hub repo ids as a model name: `Org/Name`, or `Org/Name@REVISION` (a branch, tag or commit)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The hub's rule for a user or organisation and a repo name: letters, digits, `-`, `_`, `.`;
# neither `--` nor `..` inside (the cache spells `/` as `--`), at most 96 characters each.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None = None  # None: the repo's default branch

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_repo_ref(text: str) -> RepoRef:
    """`Org/Name[@REVISION]` as a RepoRef; ValueError, saying what is expected, for anything
    else."""
    repo_id, at, revision = str(text).partition("@")
    # A revision names a file under the cache's refs/: no way out of it.
    bad_revision = at and (
        not revision.strip()
        or revision.startswith("/")
        or ".." in revision.split("/")
        or "\\" in revision
    )
    if not is_repo_id(repo_id) or bad_revision:
        raise ValueError(
            f"{text!r} is not a Hugging Face repo id: expected ORG/NAME or ORG/NAME@REVISION"
        )
    return RepoRef(repo_id, revision or None)


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text


def looks_like_repo_ref(text: str) -> bool:
    """Whether a model name reads as a repo id (a path that exists is a folder all the same:
    the caller checks that first)."""
    try:
        parse_repo_ref(text)
    except ValueError:
        return False
    return True
