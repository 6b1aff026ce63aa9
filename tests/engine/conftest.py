import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once per distinct option set) a tiny random checkpoint folder."""
    cache = {}

    def factory(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp("ckpt"), **options)
        return cache[key]

    return factory
