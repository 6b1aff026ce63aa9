"""engine.kv.prefill_attention: a prompt chunk's attention on CUDA, checked on the CPU against
the reference attention (the same SDPA calls run there)."""

import pytest
import torch

from engine.kv.prefill_attention import (
    chunk_attention,
    flash_applies,
    is_one_run,
    masked_attention,
)
from kernels import reference as ref


def _qkv(batch, n_q, n_kv, n_tokens, seq, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q, n_tokens, dim, generator=g)
    k = torch.randn(batch, n_kv, seq, dim, generator=g)
    v = torch.randn(batch, n_kv, seq, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("n_tokens,seq", [(7, 7), (5, 19), (1, 12), (16, 33)])
@pytest.mark.parametrize("group", [1, 4])
def test_a_chunk_at_the_keys_end_is_causal_attention(n_tokens, seq, group):
    q, k, v = _qkv(1, 2 * group, 2, n_tokens, seq, seed=n_tokens + seq)
    positions = torch.arange(seq - n_tokens, seq)[None]
    want = ref.attention(q, k, v, positions)
    assert want.std() > 0.1
    torch.testing.assert_close(chunk_attention(q, k, v), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_the_masked_path_takes_any_positions(window):
    q, k, v = _qkv(2, 8, 2, 5, 14, seed=3)
    positions = torch.tensor([[2, 3, 4, 5, 6], [9, 10, 11, 12, 13]])
    want = ref.attention(q, k, v, positions, sliding_window=window)
    torch.testing.assert_close(
        masked_attention(q, k, v, positions, window), want, atol=1e-5, rtol=1e-5
    )


def test_one_run_is_a_single_sequence_ending_at_the_keys_end():
    assert is_one_run(torch.arange(4, 9)[None], 9)
    assert is_one_run(torch.arange(0, 9)[None], 9)
    assert not is_one_run(torch.arange(4, 9)[None], 10)  # keys past the chunk
    assert not is_one_run(torch.tensor([[4, 6, 5, 7, 8]]), 9)  # out of order
    assert not is_one_run(torch.arange(4, 9).repeat(2, 1), 9)  # two sequences


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention is CUDA's")
@pytest.mark.parametrize("n_tokens,seq", [(5, 19), (64, 64), (48, 200)])
def test_flash_on_a_gpu_agrees_with_the_masked_path(n_tokens, seq):
    q, k, v = (t.cuda().bfloat16() for t in _qkv(1, 32, 4, n_tokens, seq, dim=128, seed=seq))
    assert flash_applies(q, k, v)
    positions = torch.arange(seq - n_tokens, seq, device="cuda")[None]
    want = masked_attention(q, k, v, positions, None).float()
    got = chunk_attention(q, k, v).float()
    assert float((got - want).norm() / want.norm()) < 1e-2  # bf16 sums in another order
