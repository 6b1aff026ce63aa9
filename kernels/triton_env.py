"""Facts about how Triton runs here, shared by every kernel module."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton kernels run through its CPU interpreter (tests, CI).

    The interpreter stores bf16 as raw uint16, so bf16 arithmetic and bf16 `tl.dot` there are
    garbage; kernels take this flag as a constexpr and upcast operands to fp32 first.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
