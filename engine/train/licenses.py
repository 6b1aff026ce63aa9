"""Decide whether a package's declared licence is permissive (MIT / BSD / Apache-2.0 / PSF-style).

Only licences that allow redistribution of derived weights without copyleft terms are kept;
anything unclear is rejected, so the corpus errs on the safe side.
"""

from __future__ import annotations

import re

# SPDX ids (and the free-text spellings packages really use) that we accept.
PERMISSIVE_IDS = {
    "mit",
    "expat",  # Debian's name for the MIT licence
    "mit-0",
    "isc",
    "0bsd",
    "bsd",
    "bsd-2-clause",
    "bsd-3-clause",
    "apache-2.0",
    "apache",
    "apache 2.0",
    "apache software license",
    "apache 2.0 license",
    "psf-2.0",
    "python-2.0",
    "cnri-python",
    "bsl-1.0",
    "isc license",
    "mit license",
    "bsd license",
    "bsd-3-clause license",
    "zlib",
    "cc0-1.0",  # numpy 2.5 declares parts under these
    "cc0",  # Debian's spelling
    "apache license 2.0",
    "apache license, version 2.0",
    "apache license version 2.0",
    "2-clause bsd",
    "3-clause bsd",
    "3-clause bsd license",
    "bsd 3-clause",
    "bsd 3-clause license",
    "revised bsd license",
    "new bsd license",
    "modified bsd license",
    "simplified bsd license",
}
PERMISSIVE_CLASSIFIERS = (
    "MIT License",
    "BSD License",
    "Apache Software License",
    "Python Software Foundation License",
    "ISC License",
)


# SPDX exceptions that add permissions to a permissive licence. Any other rider ("with Commons
# Clause", "with a non-commercial clause") may take permissions away, so it is rejected.
PERMISSIVE_EXCEPTIONS = {"llvm-exception", "swift-exception"}


def _id_ok(token: str) -> bool:
    licence, *riders = re.split(r"\s+with\s+", token.strip().lower())
    return licence.strip() in PERMISSIVE_IDS and all(
        r.strip() in PERMISSIVE_EXCEPTIONS for r in riders
    )


def expression_ok(expr: str) -> bool:
    """Evaluate an SPDX expression (AND binds tighter than OR, brackets nest): OR needs one
    permissive branch, AND needs all. Anything that does not parse is rejected."""
    tokens = [t.strip() for t in re.split(r"(\(|\)|\s+AND\s+|\s+OR\s+)", expr) if t.strip()]
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str | None:
        nonlocal pos
        pos += 1
        return tokens[pos - 1] if pos <= len(tokens) else None

    def any_of() -> bool:  # a OR b OR ...
        ok = all_of()
        while peek() == "OR":
            take()
            ok = all_of() or ok  # evaluated first, so every branch is parsed
        return ok

    def all_of() -> bool:  # a AND b AND ...
        ok = atom()
        while peek() == "AND":
            take()
            ok = atom() and ok
        return ok

    def atom() -> bool:
        token = take()
        if token == "(":
            ok = any_of()
            if take() != ")":
                raise ValueError("unbalanced brackets")
            return ok
        if token in (None, ")", "AND", "OR"):
            raise ValueError(f"unexpected {token!r}")
        return _id_ok(token)

    try:
        ok = any_of()
    except ValueError:
        return False
    return ok and pos == len(tokens)  # trailing tokens ("Apache 2.0 (with exceptions)"): rejected


def classify(metadata) -> tuple[bool, str]:
    """Return (permissive?, licence label) from a dist-info METADATA mapping."""
    expr = metadata.get("License-Expression")
    if expr:
        return expression_ok(expr), expr
    classifiers = [
        c.split("::")[-1].strip()
        for c in (metadata.get_all("Classifier") or [])
        if c.startswith("License ::")
    ]
    text = (metadata.get("License") or "").strip()
    # A short License field is an identifier; a long one is pasted licence text: trust classifiers.
    if text and len(text) < 60 and "\n" not in text:
        return expression_ok(text), text
    if classifiers:
        ok = all(any(p in c for p in PERMISSIVE_CLASSIFIERS) for c in classifiers)
        return ok, "; ".join(classifiers)
    return False, text[:60] or "unknown"
