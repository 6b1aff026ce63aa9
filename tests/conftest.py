"""Shared test set-up.

Triton kernels are checked on the CPU through Triton's interpreter; the variable must be set
before triton is first imported, which is why it lives here and not in a kernel test module.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
