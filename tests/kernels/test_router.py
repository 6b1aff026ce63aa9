"""The fused decode-step router (`kernels.router.norm_route`: residual add, RMSNorm, router
logits, softmax and top-k in one launch) and `softmax_topk`, against the torch reference,
through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1).

The interpreter truncates fp32 -> bf16 instead of rounding, and the kernel sums the logits in
another order than F.linear, so bf16 logits may differ from the reference's by an ulp or two:
ids are compared where the reference's top-k is unambiguous by more than that, weights with a
tolerance that fits the dtype.
"""

import pytest
import torch
from quantized_layers import poison_torch_empty

from kernels import reference
from kernels.fused_ops import add_rms_norm
from kernels.router import default_block_e, norm_route, softmax_topk

EPS = 1e-6
HIDDEN, EXPERTS = 72, 20  # odd sizes: masked hidden lanes and a ragged last expert block
# Smallest gap between consecutive logits of the reference's top k+1 for the ids to be
# unambiguous; weight tolerances (rtol, atol).
MARGIN = {torch.float32: 1e-4, torch.bfloat16: 0.08}
WEIGHT_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (6e-2, 1e-3)}


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every torch.empty the kernels allocate starts as NaN (ints: a large sentinel)."""
    poison_torch_empty(monkeypatch)


def top_gaps(h, router, top_k):
    """Per row, the smallest gap between consecutive logits of the top k+1 (float64)."""
    logits = h.double() @ router.double().T
    top = logits.topk(min(top_k + 1, logits.shape[1]), dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(dim=-1).values


def make_inputs(tokens, dtype, with_delta, top_k):
    """(x, delta, norm_weight, router) with every row's top-k unambiguous by MARGIN[dtype]."""
    for seed in range(1000):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        delta = torch.randn(tokens, HIDDEN, generator=gen).to(dtype) if with_delta else None
        norm_weight = (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(dtype)
        router = (torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)
        s = x + delta if with_delta else x
        h = reference.rms_norm(s, norm_weight, EPS)
        if (top_gaps(h, router, top_k) > MARGIN[dtype]).all():
            return x, delta, norm_weight, router
    raise AssertionError("no seed gave well separated top-k")


def check_route(ids, weights, ref_ids, ref_weights, dtype):
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == ref_ids.shape and weights.shape == ref_weights.shape
    assert torch.equal(ids, ref_ids)
    rtol, atol = WEIGHT_TOL[dtype]
    torch.testing.assert_close(weights, ref_weights, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("tokens,top_k,block_e", [(1, 3, 4), (5, 4, 8), (1, 8, 1)])
def test_norm_route_matches_reference(dtype, with_delta, renorm, tokens, top_k, block_e):
    x, delta, norm_weight, router = make_inputs(tokens, dtype, with_delta, top_k)
    counters = torch.zeros(tokens, dtype=torch.int32)
    s, h, ids, weights = norm_route(
        x, delta, norm_weight, EPS, router, top_k, renorm, counters=counters, block_e=block_e
    )
    assert (counters == 0).all(), "the last program of each row resets its counter"

    ref_s, ref_h = add_rms_norm(x, delta, norm_weight, EPS)
    assert s.dtype == h.dtype == dtype and s.shape == h.shape == x.shape
    if dtype == torch.float32:
        assert torch.equal(s, ref_s) and torch.equal(h, ref_h)
    else:  # one bf16 ulp
        torch.testing.assert_close(s, ref_s, rtol=2**-7, atol=0)
        torch.testing.assert_close(h, ref_h, rtol=2**-7, atol=0)
    torch.testing.assert_close(s, x + delta if with_delta else x, rtol=2**-7, atol=0)
    if not with_delta:
        assert s is x or torch.equal(s, x)

    ref_ids, ref_weights = reference.route(ref_h, router, top_k, renorm)
    check_route(ids, weights, ref_ids, ref_weights, dtype)

    again = norm_route(
        x, delta, norm_weight, EPS, router, top_k, renorm, counters=counters, block_e=block_e
    )
    for first, second in zip((s, h, ids, weights), again):
        assert torch.equal(first, second), "a second call on the same counters differs"
    assert (counters == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_e", [None, 32])
def test_norm_route_one_program_per_row(dtype, block_e):
    """Default block (one program for these small sizes) and a block wider than E; pdl=True
    falls back to a plain launch where PDL is not supported (the CPU)."""
    assert default_block_e(EXPERTS, HIDDEN) >= EXPERTS
    x, delta, norm_weight, router = make_inputs(3, dtype, True, 2)
    *_, ids, weights = norm_route(
        x, delta, norm_weight, EPS, router, 2, True, pdl=True, block_e=block_e
    )
    ref_ids, ref_weights = reference.route(
        add_rms_norm(x, delta, norm_weight, EPS)[1], router, 2, True
    )
    check_route(ids, weights, ref_ids, ref_weights, dtype)


def test_default_block_spreads_experts_over_programs():
    assert default_block_e(128, 2048) == 8  # 16 programs a row, 32 KB of bf16 weights each
    assert default_block_e(512, 8192) == 2
    assert default_block_e(4, 64) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_rounded_to_activation_dtype(dtype):
    """Two experts whose fp32 logits 256.75 and 256 are one bf16 value (256): in bf16 they tie
    (weights 1/2, lower id first), in fp32 they do not. The two sit in different programs."""
    top_k, first, second = 2, 3, 17
    x = torch.ones(1, HIDDEN, dtype=dtype)
    norm_weight = torch.ones(HIDDEN, dtype=dtype)  # with eps 0, h is all ones exactly
    router = torch.zeros(EXPERTS, HIDDEN, dtype=dtype)
    router[second, :2] = 128.0
    router[first, :2] = 128.0
    router[first, 2] = 0.75
    _, h, ids, weights = norm_route(x, None, norm_weight, 0.0, router, top_k, False, block_e=4)
    assert torch.equal(h, torch.ones_like(h))
    ref_ids, ref_weights = reference.route(h, router, top_k, False)
    check_route(ids, weights, ref_ids.sort(dim=-1).values, ref_weights, dtype)
    if dtype == torch.bfloat16:
        assert ids.tolist() == [[first, second]]
        assert weights.tolist() == [[0.5, 0.5]]
    else:
        assert weights[0, 0] > 0.6


def test_norm_route_without_tokens():
    router = torch.randn(EXPERTS, HIDDEN)
    s, h, ids, weights = norm_route(
        torch.randn(0, HIDDEN), None, torch.ones(HIDDEN), EPS, router, 2, True
    )
    assert s.shape == h.shape == (0, HIDDEN) and ids.shape == weights.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,experts,top_k,renorm", [(1, 8, 2, True), (5, 61, 6, False), (4, 10, 3, True)]
)
def test_softmax_topk_matches_reference(dtype, tokens, experts, top_k, renorm):
    gen = torch.Generator().manual_seed(experts)
    for _ in range(100):  # distinct logits, so the reference's order is unambiguous
        logits = (2 * torch.randn(tokens, experts, generator=gen)).to(dtype)
        if (top_gaps(logits, torch.eye(experts), top_k) > 0).all():
            break
    ids, weights = softmax_topk(logits, top_k, renorm)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ref_ids, ref_weights = reference.route_probs(probs, top_k, renorm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
