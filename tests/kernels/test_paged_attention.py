"""Triton paged decode attention against the torch reference, through Triton's interpreter on
the CPU."""

import pytest
import torch

from kernels import reference as ref
from kernels.paged_attention import paged_decode_attention


def _case(lengths, n_heads=4, n_kv=2, head_dim=24, block_size=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths)
    n_blocks = len(lengths) * max_blocks + 3
    keys = torch.randn(n_blocks * block_size, n_kv, head_dim, generator=g).to(dtype)
    values = torch.randn(n_blocks * block_size, n_kv, head_dim, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g)  # blocks scattered over the pool
    tables = perm[: len(lengths) * max_blocks].view(len(lengths), max_blocks).to(torch.int32)
    q = torch.randn(len(lengths), n_heads, head_dim, generator=g).to(dtype)
    return q, keys, values, tables, torch.tensor(lengths, dtype=torch.int32)


def _reference(q, keys, values, tables, lengths, block_size, k_scale=None, v_scale=None):
    out = []
    for b, n in enumerate(lengths.tolist()):
        slots = (tables[b].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k, v = keys[slots].float(), values[slots].float()
        if k_scale is not None:
            k, v = k * k_scale[slots][..., None], v * v_scale[slots][..., None]
        o = ref.attention(
            q[b : b + 1, :, None].float(),
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            torch.tensor([[n - 1]]),
        )
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("lengths", [[1], [5, 17], [40, 3, 9]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_splits", [None, 1, 3, 16])  # 16: more splits than tiles, some empty
def test_matches_reference(lengths, dtype, n_splits, monkeypatch):
    monkeypatch.setattr("kernels.paged_attention.TILE", 4)  # several tiles per split
    q, keys, values, tables, lens = _case(lengths, dtype=dtype, seed=len(lengths))
    out = paged_decode_attention(q, keys, values, tables, lens, block_size=4, n_splits=n_splits)
    expected = _reference(q, keys, values, tables, lens, 4)
    assert torch.isfinite(out.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - expected).abs().max().item() < tol


def test_wide_table_reads_only_each_length():
    """A CUDA graph replays one launch for a table as wide as the longest context: entries past a
    sequence's length hold stale block ids and must not change its output."""
    q, keys, values, tables, lens = _case([6, 11], seed=3)
    stale = torch.randint(
        0,
        tables.max().item() + 1,
        (2, 9),
        dtype=torch.int32,
        generator=torch.Generator().manual_seed(1),
    )
    wide = torch.cat([tables, stale], dim=1)
    out = paged_decode_attention(q, keys, values, wide, lens, 4, n_splits=5)
    assert (out - _reference(q, keys, values, tables, lens, 4)).abs().max().item() < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_rows_of_one_sequence_at_consecutive_positions(fp8, n_splits, monkeypatch):
    """A prompt's tail after a cache hit runs as one step with a row per new token: every row
    reads the one table, each up to its own position, so each sees the rows before it (the
    tokens the kernel reads after its wait, as this step's)."""
    monkeypatch.setattr("kernels.paged_attention.TILE", 4)
    q, keys, values, tables, _ = _case([14, 14, 14, 14], seed=9)
    tables[:] = tables[0]
    lens = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    scales = (None, None)
    if fp8:
        scales = (keys.abs().amax(-1) / 448.0, values.abs().amax(-1) / 448.0)
        keys = (keys / scales[0][..., None]).to(torch.float8_e4m3fn)
        values = (values / scales[1][..., None]).to(torch.float8_e4m3fn)
        q = q.to(torch.bfloat16)
    out = paged_decode_attention(q, keys, values, tables, lens, 4, *scales, n_splits=n_splits)
    expected = _reference(q, keys.float(), values.float(), tables, lens, 4, *scales)
    assert (out.float() - expected).abs().max().item() < (2e-2 if fp8 else 1e-5)


def test_fp8_storage_with_scales():
    q, keys, values, tables, lens = _case([13, 6], seed=5)
    k_scale = keys.abs().amax(-1) / 448.0
    v_scale = values.abs().amax(-1) / 448.0
    k8 = (keys / k_scale[..., None]).to(torch.float8_e4m3fn)
    v8 = (values / v_scale[..., None]).to(torch.float8_e4m3fn)
    out = paged_decode_attention(
        q.to(torch.bfloat16), k8, v8, tables, lens, 4, k_scale, v_scale
    ).float()
    expected = _reference(q, k8.float(), v8.float(), tables, lens, 4, k_scale, v_scale)
    assert (out - expected).abs().max().item() < 2e-2  # bf16 operands


@pytest.mark.parametrize("lengths", [[1], [5, 17], [40, 3, 9]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_splits", [None, 1, 3, 16])  # 16: more splits than tiles, some empty
def test_fused_merge_matches_reference(lengths, dtype, n_splits, monkeypatch):
    """One launch: the last split program of each (sequence, kv head) merges, and leaves its
    counter at 0."""
    monkeypatch.setattr("kernels.paged_attention.TILE", 4)  # several tiles per split
    q, keys, values, tables, lens = _case(lengths, n_heads=6, dtype=dtype, seed=len(lengths))
    counters = torch.zeros(len(lengths) * 2 + 1, dtype=torch.int32)  # spare element stays 0
    out = paged_decode_attention(
        q, keys, values, tables, lens, 4, n_splits=n_splits, fused_merge=True, counters=counters
    )
    expected = _reference(q, keys, values, tables, lens, 4)
    assert torch.isfinite(out.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - expected).abs().max().item() < tol
    assert not counters.any()


def test_fused_merge_replays_with_the_same_counters():
    """Two calls through one counter buffer (what a CUDA-graph replay does) give one result,
    the same as the two-launch path's."""
    q, keys, values, tables, lens = _case([21, 2, 14], n_heads=8, seed=7)
    counters = torch.zeros(3 * 2, dtype=torch.int32)
    args = (q, keys, values, tables, lens, 4)
    first = paged_decode_attention(*args, n_splits=4, fused_merge=True, counters=counters)
    again = paged_decode_attention(*args, n_splits=4, fused_merge=True, counters=counters)
    assert torch.equal(first, again)
    assert not counters.any()
    two_launches = paged_decode_attention(*args, n_splits=4)
    assert (first - two_launches).abs().max().item() < 1e-6
    assert (first - _reference(*args)).abs().max().item() < 1e-5


def test_fused_merge_merges_once_per_head(monkeypatch):
    """Only the last split program of a (sequence, kv head) merges (the interpreter runs the
    programs one after another, so a merge by an earlier one would be overwritten unseen)."""
    import kernels.paged_attention as pa

    merges = []
    merge = pa._merge_splits

    def counted(*args):
        merges.append(args)
        return merge(*args)

    monkeypatch.setattr(pa, "_merge_splits", counted)
    q, keys, values, tables, lens = _case([21, 2, 14], n_heads=8, seed=7)
    paged_decode_attention(q, keys, values, tables, lens, 4, n_splits=4, fused_merge=True)
    assert len(merges) == 3 * 8


def test_fused_merge_allocates_counters_when_none():
    q, keys, values, tables, lens = _case([9, 30], seed=11)
    out = paged_decode_attention(q, keys, values, tables, lens, 4, n_splits=3, fused_merge=True)
    assert (out - _reference(q, keys, values, tables, lens, 4)).abs().max().item() < 1e-5


def test_fused_merge_rejects_a_short_counter_buffer():
    q, keys, values, tables, lens = _case([9, 30], seed=11)
    with pytest.raises(ValueError, match="counters"):
        paged_decode_attention(
            q,
            keys,
            values,
            tables,
            lens,
            4,
            n_splits=3,
            fused_merge=True,
            counters=torch.zeros(3, dtype=torch.int32),
        )


@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("fused_merge", [False, True])
def test_fp8_storage_with_scales_fused(n_splits, fused_merge):
    q, keys, values, tables, lens = _case([13, 6, 1], n_heads=6, seed=5)
    k_scale = keys.abs().amax(-1) / 448.0
    v_scale = values.abs().amax(-1) / 448.0
    k8 = (keys / k_scale[..., None]).to(torch.float8_e4m3fn)
    v8 = (values / v_scale[..., None]).to(torch.float8_e4m3fn)
    counters = torch.zeros(3 * 2, dtype=torch.int32)
    out = paged_decode_attention(
        q.to(torch.bfloat16),
        k8,
        v8,
        tables,
        lens,
        4,
        k_scale,
        v_scale,
        n_splits=n_splits,
        fused_merge=fused_merge,
        counters=counters,
    ).float()
    expected = _reference(q, k8.float(), v8.float(), tables, lens, 4, k_scale, v_scale)
    assert (out - expected).abs().max().item() < 2e-2  # bf16 operands
    assert not counters.any()
