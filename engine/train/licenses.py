"""Decide whether a package's declared licence is permissive (MIT / BSD / Apache-2.0 / PSF-style).

Only licences that allow redistribution of derived weights without copyleft terms are kept;
anything unclear is rejected, so the corpus errs on the safe side.
"""
from __future__ import annotations

import re

# SPDX ids (and the free-text spellings packages really use) that we accept.
PERMISSIVE_IDS = {
    "mit", "mit-0", "isc", "0bsd", "bsd", "bsd-2-clause", "bsd-3-clause", "apache-2.0", "apache",
    "apache 2.0", "apache software license", "apache 2.0 license", "psf-2.0", "python-2.0",
    "cnri-python", "bsl-1.0", "isc license", "mit license", "bsd license", "bsd-3-clause license",
    "zlib", "cc0-1.0",  # numpy 2.5 declares parts under these
    "apache license 2.0", "apache license, version 2.0", "apache license version 2.0",
    "2-clause bsd", "3-clause bsd", "3-clause bsd license", "bsd 3-clause", "bsd 3-clause license",
    "revised bsd license", "new bsd license", "modified bsd license", "simplified bsd license",
}
PERMISSIVE_CLASSIFIERS = ("MIT License", "BSD License", "Apache Software License",
                          "Python Software Foundation License", "ISC License")


def _id_ok(token: str) -> bool:
    token = token.strip().strip("()").strip().lower()
    token = token.split(" with ")[0].strip()  # "Apache-2.0 WITH LLVM-exception" is still Apache
    return token in PERMISSIVE_IDS


def expression_ok(expr: str) -> bool:
    """Evaluate a (flat) SPDX expression: OR needs one permissive branch, AND needs all."""
    expr = re.sub(r"[()]", " ", expr).strip()
    if not expr:
        return False
    return any(all(_id_ok(part) for part in re.split(r"\s+AND\s+", alt))
               for alt in re.split(r"\s+OR\s+", expr))


def classify(metadata) -> tuple[bool, str]:
    """Return (permissive?, licence label) from a dist-info METADATA mapping."""
    expr = metadata.get("License-Expression")
    if expr:
        return expression_ok(expr), expr
    classifiers = [c.split("::")[-1].strip() for c in (metadata.get_all("Classifier") or [])
                   if c.startswith("License ::")]
    text = (metadata.get("License") or "").strip()
    # A short License field is an identifier; a long one is pasted licence text: trust classifiers.
    if text and len(text) < 60 and "\n" not in text:
        return expression_ok(text), text
    if classifiers:
        ok = all(any(p in c for p in PERMISSIVE_CLASSIFIERS) for c in classifiers)
        return ok, "; ".join(classifiers)
    return False, text[:60] or "unknown"
