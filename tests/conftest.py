"""Shared test set-up.

Triton kernels are checked on the CPU through Triton's interpreter; the variable must be set
before triton is first imported, which is why it lives here and not in a kernel test module.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers: checkpoints.py


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once per distinct option set) a tiny random Qwen3-MoE checkpoint folder."""
    from checkpoints import make_checkpoint

    cache = {}

    def factory(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp("ckpt"), **options)
        return cache[key]

    return factory
