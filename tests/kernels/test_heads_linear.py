"""The decode step's attention inputs: `AttentionHeads.store` (q/k RMSNorm, RoPE, the K/V store)
against torch's reference ops, and the q/k/v GEMV with them as its epilogue (`heads_linear`)
against the GEMV followed by that kernel, bit for bit (Triton interpreter on the CPU)."""

import pytest
import torch
from quantized_layers import poison_torch_empty, quantize

from kernels import gemv
from kernels import reference as ref
from kernels.counters import counters_of
from kernels.fused_ops import AttentionHeads, add_rms_norm
from kernels.gemv import COUNTERS_USER, heads_linear, norm_linear, skinny_linear

HEAD_DIM, N_Q, N_KV, HIDDEN, SLOTS = 32, 4, 2, 96, 40
N_OUT = (N_Q + 2 * N_KV) * HEAD_DIM


def _heads(rows, dtype, seed, pool_dtype=None):
    """AttentionHeads for `rows` tokens at scattered slots of a pool full of noise."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 500, (rows,), generator=g)
    inv_freq = ref.rope_inv_freq(HEAD_DIM, 10000.0)
    cos, sin = ref.rope_cos_sin(positions, inv_freq, dtype)
    pool_dtype = pool_dtype or dtype
    return AttentionHeads(
        q_norm=(1 + 0.3 * torch.randn(HEAD_DIM, generator=g)).to(dtype),
        k_norm=(1 + 0.3 * torch.randn(HEAD_DIM, generator=g)).to(dtype),
        cos=cos,
        sin=sin,
        key_dst=torch.randn(SLOTS, N_KV, HEAD_DIM, generator=g).to(pool_dtype),
        value_dst=torch.randn(SLOTS, N_KV, HEAD_DIM, generator=g).to(pool_dtype),
        slots=torch.randperm(SLOTS, generator=g)[:rows],
        n_q_heads=N_Q,
        n_kv_heads=N_KV,
        eps=1e-6,
    )


def _copy(heads: AttentionHeads) -> AttentionHeads:
    """The same heads with their own copy of the pool."""
    return AttentionHeads(
        **{
            **vars(heads),
            "key_dst": heads.key_dst.clone(),
            "value_dst": heads.value_dst.clone(),
        }
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_qk_norm_rope_store_is_the_reference_norm_rope_and_store(dtype, rows, monkeypatch):
    poison_torch_empty(monkeypatch)
    heads = _heads(rows, dtype, seed=rows)
    g = torch.Generator().manual_seed(7)
    qkv = (2 * torch.randn(rows, N_OUT, generator=g)).to(dtype)
    before_k, before_v = heads.key_dst.clone(), heads.value_dst.clone()
    q = heads.store(qkv)

    q_in, k_in, v_in = qkv.view(rows, -1, HEAD_DIM).split([N_Q, N_KV, N_KV], dim=1)
    cos, sin = heads.cos[:, None], heads.sin[:, None]  # [T, 1, D] over the heads
    expected_q = ref.apply_rope(ref.rms_norm(q_in, heads.q_norm, heads.eps), cos, sin)
    expected_k = ref.apply_rope(ref.rms_norm(k_in, heads.k_norm, heads.eps), cos, sin)
    # bf16: a few roundings of the top values apart (rsqrt and sums in another order)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in ((q, expected_q), (heads.key_dst[heads.slots], expected_k)):
        err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
        assert err < tol
    assert torch.equal(heads.value_dst[heads.slots], v_in)
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[heads.slots] = False
    assert torch.equal(heads.key_dst[others], before_k[others])
    assert torch.equal(heads.value_dst[others], before_v[others])


def _weight(fmt, g):
    dense = torch.randn(N_OUT, HIDDEN, generator=g) / HIDDEN**0.5
    if fmt == "fp32":
        return dense
    if fmt == "bf16":
        return dense.bfloat16()
    return quantize(dense, fmt, 32)


@pytest.mark.parametrize(
    "fmt,rows,block_n,split_k,bias,norm",
    [
        ("fp32", 1, 16, 1, False, False),
        ("fp32", 3, 32, 3, True, True),
        ("bf16", 1, 16, 2, False, False),
        ("bf16", 5, 64, 1, True, False),  # a stripe cut to one head
        ("bf16", 2, 8, 3, False, True),
        ("fp8", 1, 16, 3, False, False),
        ("fp8", 3, 32, 1, True, True),
        ("int4", 1, 16, 2, False, True),
        ("int4", 4, 32, 3, False, False),
    ],
)
def test_the_epilogue_equals_the_gemv_then_the_heads_kernel(
    fmt, rows, block_n, split_k, bias, norm, monkeypatch
):
    """The same bits as the separate launches: q, the K/V written at the rows' slots, every
    other slot untouched, the residual sum, and the arrival counters back at zero."""
    poison_torch_empty(monkeypatch)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(block_n * 10 + rows)
    x = (3 * torch.randn(rows, HIDDEN, generator=g)).to(dtype)
    w = _weight(fmt, g)
    b = torch.randn(N_OUT, generator=g).to(dtype) if bias else None
    heads = _heads(rows, dtype, seed=split_k + rows)
    fused_heads = _copy(heads)
    tiles = dict(block_n=block_n, block_k=32, split_k=split_k)
    if norm:
        delta = torch.randn(rows, HIDDEN, generator=g).to(dtype)
        norm_w = (1 + 0.3 * torch.randn(HIDDEN, generator=g)).to(dtype)
        total, qkv = norm_linear(x, delta, norm_w, 1e-6, w, b, **tiles)
        fused_total, q = heads_linear(x, w, b, fused_heads, delta, norm_w, 1e-6, **tiles)
        assert torch.equal(fused_total, total)
    else:
        qkv = skinny_linear(x, w, b, **tiles)
        _, q = heads_linear(x, w, b, fused_heads, **tiles)
    expected_q = heads.store(qkv)
    assert torch.isfinite(q.float()).all()
    assert torch.equal(q, expected_q)
    assert torch.equal(fused_heads.key_dst, heads.key_dst)
    assert torch.equal(fused_heads.value_dst, heads.value_dst)
    assert not counters_of(x.device, COUNTERS_USER).any()


def test_destinations_of_another_dtype_take_what_the_separate_kernel_stores():
    """K/V destinations in another dtype than the activations (fp32 here) take the same values
    the separate kernel stores there."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, HIDDEN, generator=g).bfloat16()
    w = _weight("bf16", g)
    heads = _heads(2, torch.bfloat16, seed=9, pool_dtype=torch.float32)
    fused_heads = _copy(heads)
    heads.store(skinny_linear(x, w, block_n=16, block_k=32))
    heads_linear(x, w, None, fused_heads, block_n=16, block_k=32)
    assert torch.equal(fused_heads.key_dst, heads.key_dst)
    assert torch.equal(fused_heads.value_dst, heads.value_dst)


def test_the_norm_prologue_reads_a_long_row_in_steps(monkeypatch):
    """Rows longer than MAX_NORM_BLOCK: the statistics in several steps, the sum stored whole,
    the epilogue's q and K/V the same as the separate launches'."""
    poison_torch_empty(monkeypatch)
    monkeypatch.setattr(gemv, "MAX_NORM_BLOCK", 32)  # HIDDEN = 96: three steps
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(3, HIDDEN, generator=g)).bfloat16()
    delta = torch.randn(3, HIDDEN, generator=g).bfloat16()
    norm_w = (1 + 0.3 * torch.randn(HIDDEN, generator=g)).bfloat16()
    w = _weight("bf16", g)
    heads = _heads(3, torch.bfloat16, seed=4)
    fused_heads = _copy(heads)
    tiles = dict(block_n=32, block_k=32, split_k=2)
    total, qkv = norm_linear(x, delta, norm_w, 1e-6, w, **tiles)
    ref_total, h = add_rms_norm(x, delta, norm_w, 1e-6)
    assert torch.equal(total, ref_total)
    expected = h.double() @ w.double().T
    assert ((qkv.double() - expected).abs().max() / expected.abs().max()).item() < 2e-2
    _, q = heads_linear(x, w, None, fused_heads, delta, norm_w, 1e-6, **tiles)
    assert torch.equal(q, heads.store(qkv))
    assert torch.equal(fused_heads.key_dst, heads.key_dst)
    assert torch.equal(fused_heads.value_dst, heads.value_dst)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("norm", [False, True])
def test_the_epilogue_on_the_gpu_equals_the_separate_launches(fmt, rows, norm):
    """Compiled at the 30B-A3B attention shape with the tuned tiles, programs arriving in any
    order: the same bits as the GEMV (with the add + RMSNorm prologue and a bias, or without)
    followed by the heads kernel, three launches in a row (the counters reset each time)."""
    from kernels.quant import to

    g = torch.Generator().manual_seed(rows)
    head_dim, n_q, n_kv, hidden, slots = 128, 32, 4, 2048, 64
    dense = torch.randn((n_q + 2 * n_kv) * head_dim, hidden, generator=g) / hidden**0.5
    w = to(dense.bfloat16() if fmt == "bf16" else quantize(dense, fmt, 128), "cuda")
    x = torch.randn(rows, hidden, generator=g).bfloat16().cuda()
    positions = torch.randint(0, 4000, (rows,), generator=g)
    cos, sin = ref.rope_cos_sin(positions, ref.rope_inv_freq(head_dim, 1e6), torch.bfloat16)

    def heads():
        gen = torch.Generator().manual_seed(5)
        return AttentionHeads(
            q_norm=(1 + 0.3 * torch.randn(head_dim, generator=gen)).bfloat16().cuda(),
            k_norm=(1 + 0.3 * torch.randn(head_dim, generator=gen)).bfloat16().cuda(),
            cos=cos.cuda(),
            sin=sin.cuda(),
            key_dst=torch.randn(slots, n_kv, head_dim, generator=gen).bfloat16().cuda(),
            value_dst=torch.randn(slots, n_kv, head_dim, generator=gen).bfloat16().cuda(),
            slots=torch.randperm(slots, generator=gen)[:rows].cuda(),
            n_q_heads=n_q,
            n_kv_heads=n_kv,
            eps=1e-6,
        )

    if norm:
        delta = torch.randn(rows, hidden, generator=g).bfloat16().cuda()
        norm_w = (1 + 0.3 * torch.randn(hidden, generator=g)).bfloat16().cuda()
        bias = torch.randn(w.shape[0], generator=g).bfloat16().cuda()
        prologue = (delta, norm_w, 1e-6)
        expected_total, qkv = norm_linear(x, delta, norm_w, 1e-6, w, bias)
    else:
        bias, prologue = None, ()
        qkv = skinny_linear(x, w)
    separate = heads()
    expected_q = separate.store(qkv)
    for _ in range(3):
        fused = heads()
        total, q = heads_linear(x, w, bias, fused, *prologue)
        if norm:
            assert torch.equal(total, expected_total)
        assert torch.equal(q, expected_q)
        assert torch.equal(fused.key_dst, separate.key_dst)
        assert torch.equal(fused.value_dst, separate.value_dst)
    assert not counters_of(x.device, COUNTERS_USER).any()
