"""The torch reference ops against float64 / first-principles versions, on fresh random inputs."""

import math

import pytest
import torch

from kernels import reference as ref


def _moe_inputs(tokens, hidden=64, inter=48, experts=8, k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=g) / math.sqrt(inter)).to(dtype)
    router = torch.randn(experts, hidden, generator=g).to(dtype)
    ids, weights = ref.route(x, router, k, norm_topk_prob=True)
    return x, w_gate_up, w_down, ids, weights


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("path", [ref.moe_expert_centric, ref.moe_output_centric])
def test_moe_paths_match_float64_in_fp32(tokens, path):
    args = _moe_inputs(tokens, seed=tokens)
    out = path(*args)
    exact = ref.moe_float64(*args)
    assert torch.isfinite(out).all()
    assert _rel(out, exact) < 1e-5


@pytest.mark.parametrize("path", [ref.moe_expert_centric, ref.moe_output_centric])
def test_moe_paths_in_bf16_within_bf16_rounding(path):
    args = _moe_inputs(8, dtype=torch.bfloat16, seed=7)
    out = path(*args)
    exact = ref.moe_float64(*args)
    assert _rel(out, exact) < 1e-2  # a few bf16 ulps (2^-8 relative) at most


def test_output_centric_is_at_least_as_close_to_float64_in_bf16():
    errors = {"expert": 0.0, "output": 0.0}
    for seed in range(4):
        args = _moe_inputs(4, dtype=torch.bfloat16, seed=100 + seed)
        exact = ref.moe_float64(*args)
        errors["expert"] += _rel(ref.moe_expert_centric(*args), exact)
        errors["output"] += _rel(ref.moe_output_centric(*args), exact)
    assert errors["output"] <= errors["expert"]


def test_route_renormalises_only_when_asked():
    g = torch.Generator().manual_seed(3)
    x, router = torch.randn(5, 16, generator=g), torch.randn(8, 16, generator=g)
    ids, w = ref.route(x, router, 3, norm_topk_prob=True)
    assert torch.allclose(w.sum(-1), torch.ones(5))
    ids2, w2 = ref.route(x, router, 3, norm_topk_prob=False)
    probs = torch.softmax(x @ router.T, dim=-1)
    assert torch.equal(ids, ids2)
    assert torch.allclose(w2, probs.gather(1, ids2))
    assert (w2.sum(-1) < 1).all()


def test_rms_norm_and_rope_first_principles():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(ref.rms_norm(x, w, 1e-6), expected, atol=1e-6)
    # RoPE rotates each (i, i + D/2) pair by position * freq_i: norms are kept, dot products
    # between rotated q and k depend only on the position difference.
    inv = ref.rope_inv_freq(16, 10000.0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def rot(v, pos):
        cos, sin = ref.rope_cos_sin(torch.tensor([pos]), inv, torch.float32)
        return ref.apply_rope(v[None], cos, sin)[0]

    assert torch.allclose(rot(q, 5).norm(), q.norm(), atol=1e-5)
    assert torch.allclose(rot(q, 7) @ rot(k, 3), rot(q, 104) @ rot(k, 100), atol=1e-4)


def test_attention_decode_equals_prefill_row():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    pos = torch.arange(6)[None].expand(2, 6)
    full = ref.attention(q, k, v, pos)
    last = ref.attention(q[:, :, -1:], k, v, pos[:, -1:])
    assert torch.allclose(full[:, :, -1:], last, atol=1e-6)
    # GQA: query head h reads kv head h // (Hq / Hkv); check head 3 against a single-head softmax.
    scores = q[0, 3] @ k[0, 1].T / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    assert torch.allclose(full[0, 3], torch.softmax(scores, -1) @ v[0, 1], atol=1e-6)


@pytest.mark.parametrize("sliding_window", [None, 13])
@pytest.mark.parametrize("run_lengths, n_tokens", [([40], 40), ([7, 16, 21], 30), ([5, 60], 17)])
def test_fused_prefill_attention_over_runs_equals_materialised(
    run_lengths, n_tokens, sliding_window
):
    # A prefill chunk (n_tokens >= FUSED_PREFILL_ROWS) takes the fused path; the oracle is the
    # materialised-scores attention over the same keys and values joined.
    assert n_tokens >= ref.FUSED_PREFILL_ROWS
    g = torch.Generator().manual_seed(sum(run_lengths) + n_tokens)
    n_q, n_kv, head_dim = 6, 2, 16
    seq = sum(run_lengths)
    keys = [torch.randn(n, n_kv, head_dim, generator=g) for n in run_lengths]
    values = [torch.randn(n, n_kv, head_dim, generator=g) for n in run_lengths]
    q = torch.randn(n_q, n_tokens, head_dim, generator=g)
    positions = torch.arange(seq - n_tokens, seq)
    out = ref.attention_over_runs(q, keys, values, positions, sliding_window)
    k = torch.cat(keys).transpose(0, 1)[None]
    v = torch.cat(values).transpose(0, 1)[None]
    expected = ref.attention(q[None], k, v, positions[None], sliding_window=sliding_window)[0]
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
