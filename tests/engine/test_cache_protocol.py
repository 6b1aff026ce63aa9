"""Both KV caches implement every method of the model's cache protocol (`ModelCache`)."""

import inspect

import pytest
import torch

from engine.kv.cache import ModelCache
from engine.kv.contiguous import KVCache
from engine.kv.pool import KVPool, PagedBatch

PROTOCOL_METHODS = sorted(
    name
    for name, member in vars(ModelCache).items()
    if inspect.isfunction(member) and not name.startswith("_")
)


def test_the_protocol_names_the_methods_a_forward_calls():
    assert PROTOCOL_METHODS == ["attend", "layer_stores", "lean_rows", "reserve"]


@pytest.mark.parametrize("cache_class", [KVCache, PagedBatch])
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_each_cache_defines_each_protocol_method(cache_class, method):
    """Defined by the cache itself: the protocol's own methods only raise."""
    own = inspect.getattr_static(cache_class, method)
    assert own is not vars(ModelCache)[method]
    assert inspect.signature(own).parameters.keys() == (
        inspect.signature(vars(ModelCache)[method]).parameters.keys()
    )


def test_a_method_left_out_fails_loudly():
    class Forgetful(ModelCache):
        pass

    with pytest.raises(NotImplementedError):
        Forgetful().lean_rows(0, 1)


def test_both_caches_answer_through_the_protocol():
    pool = KVPool(2, 4, 4, 2, 8, torch.float32, "cpu")
    for cache in (KVCache(2, 1, 2, 8, 16, torch.float32, "cpu"), PagedBatch(pool, [[1, 2]], "cpu")):
        cache.reserve(5)
        assert cache.lean_rows(0, 3) is not None
        keys, values = cache.layer_stores(1)
        assert keys.shape[-2:] == values.shape[-2:] == (2, 8)
