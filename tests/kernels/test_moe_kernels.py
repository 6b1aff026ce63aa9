"""Triton MoE kernels (warp decode and its variants, expert-centric fused MoE, router,
dispatcher) against the torch references, through Triton's CPU interpreter (tests/conftest.py
sets TRITON_INTERPRET=1).

The interpreter truncates fp32 -> bf16 instead of rounding, so outputs are compared with a
bf16-sized tolerance, never bit for bit. Every check draws fresh random inputs and poisons the
outputs with NaN first, so an element the kernel fails to write cannot pass.
"""

import pytest
import torch
from quantized_layers import poison_torch_empty

from kernels import dispatch, reference
from kernels.counters import counters_of
from kernels.fused_moe import fused_moe
from kernels.moe_align import align_by_expert
from kernels.pdl import pdl_supported
from kernels.router import route as triton_route
from kernels.warp_decode import PERSISTENT_COUNTERS, warp_decode_moe
from kernels.warp_decode_batched import warp_decode_batched_moe
from kernels.warp_decode_dedup import warp_decode_dedup_moe

# Small tiles so the K loops run several steps and the masks see ragged tails.
WARP_SMALL = {
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "num_warps": 4},
    "down": {"BLOCK_H": 16, "BLOCK_I": 16, "num_warps": 4},
}
FUSED_SMALL = {
    "BLOCK_M": 16,
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
}

# (tokens, hidden, inter, experts, top_k): the small shape, then sizes that are not
# multiples of any block (masks), a non-power-of-two k, and one expert per token.
SHAPES = [
    (1, 64, 48, 8, 2),
    (3, 64, 48, 8, 2),
    (8, 64, 48, 8, 2),
    (5, 70, 40, 6, 3),
    (2, 40, 24, 4, 1),
]


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every torch.empty the kernels allocate starts as NaN (ints: a large sentinel)."""
    poison_torch_empty(monkeypatch)


def make_layer(tokens, hidden, inter, experts, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).bfloat16()
    router = torch.randn(experts, hidden, generator=gen).bfloat16()
    ids, weights = reference.route(x, router, top_k, norm_topk_prob=True)
    return x, w_gate_up, w_down, ids, weights


def rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def check_moe(y, x, w_gate_up, w_down, ids, weights, oracle):
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "unwritten (NaN) or broken outputs"
    ref = oracle(x, w_gate_up, w_down, ids, weights)
    # bf16 keeps 8 bits; the interpreter's truncating casts can double that error.
    assert rel_err(y, ref) < 2e-2
    torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=5e-2)


@pytest.mark.parametrize("shape", SHAPES)
def test_warp_decode_matches_reference(shape):
    layer = make_layer(*shape, seed=hash(shape) % 1000)
    y = warp_decode_moe(*layer, config=WARP_SMALL)
    check_moe(y, *layer, reference.moe_output_centric)


def test_warp_decode_overlap_config_falls_back_without_pdl():
    # The interpreter cannot run griddepcontrol / prefetch PTX: an overlap config must run as
    # the plain pair there (and on GPUs before Hopper).
    assert not pdl_supported(0)
    layer = make_layer(5, 70, 40, 6, 3, seed=31)
    cfg = {
        "gate_up": dict(WARP_SMALL["gate_up"], prefetch_down=True),
        "down": dict(WARP_SMALL["down"], pdl=True, prefetch=True),
    }
    check_moe(warp_decode_moe(*layer, config=cfg), *layer, reference.moe_output_centric)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preload", [True, 32, 4096], ids=["first-step", "two-steps", "whole-row"])
def test_warp_decode_preloaded_columns(shape, preload):
    # Down rows loaded ahead of the (PDL) wait: the first step's columns (16), two steps' (the
    # loop goes on from the third where the row is longer: inter 48, 40 with a ragged last
    # step), or the whole row (ragged: masked past its end; no loop).
    layer = make_layer(*shape, seed=hash(shape) % 1000 + 5)
    cfg = {
        "gate_up": WARP_SMALL["gate_up"],
        "down": dict(WARP_SMALL["down"], pdl=True, preload=preload),
    }
    check_moe(warp_decode_moe(*layer, config=cfg), *layer, reference.moe_output_centric)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preload", [False, True, 32], ids=["none", "first-step", "two-steps"])
def test_persistent_warp_decode_is_the_pair_in_one_launch(shape, preload):
    # One launch, a few programs taking tickets (gate/up items, then down items that wait for
    # their token's): the same items as the pair, so the same bits; and each launch leaves its
    # counters at zero, so launches (and graph replays) repeat.
    layer = make_layer(*shape, seed=hash(shape) % 1000 + 7)
    pair = {"gate_up": WARP_SMALL["gate_up"], "down": dict(WARP_SMALL["down"], preload=preload)}
    persistent = dict(pair, persistent=4)
    expected = warp_decode_moe(*layer, config=pair)
    for _ in range(2):
        y = warp_decode_moe(*layer, config=persistent)
        assert torch.equal(y, expected)
        assert not counters_of(y.device, PERSISTENT_COUNTERS).any()
    check_moe(y, *layer, reference.moe_output_centric)


def _dedup_small(group):
    return {
        "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "GROUP": group, "num_warps": 4},
        "down": dict(WARP_SMALL["down"], pdl=True, prefetch=True),
    }


# Many tokens over few experts: most experts serve several tokens, more than one GROUP pass.
@pytest.mark.parametrize(
    "shape,group", [(s, 2) for s in SHAPES] + [((20, 64, 48, 8, 2), 1), ((13, 40, 24, 4, 3), 4)]
)
def test_dedup_warp_decode_matches_reference(shape, group):
    layer = make_layer(*shape, seed=hash(shape) % 1000 + 3)
    y = warp_decode_dedup_moe(*layer, config=_dedup_small(group))
    check_moe(y, *layer, reference.moe_output_centric)


def test_dedup_warp_decode_default_config_and_int32_ids():
    x, w_gate_up, w_down, ids, weights = make_layer(6, 64, 48, 8, 2, seed=13)
    layer = (x, w_gate_up, w_down, ids.to(torch.int32), weights)
    check_moe(warp_decode_dedup_moe(*layer), *layer, reference.moe_output_centric)


BATCHED_SMALL = {
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_H": 16, "BLOCK_I": 16, "num_warps": 4, "num_stages": 2},
}


@pytest.mark.parametrize("shape", SHAPES + [(20, 64, 48, 8, 2)])
def test_batched_warp_decode_matches_reference(shape):
    layer = make_layer(*shape, seed=hash(shape) % 1000 + 2)
    y = warp_decode_batched_moe(*layer, config=BATCHED_SMALL)
    check_moe(y, *layer, reference.moe_output_centric)


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_reference(shape):
    layer = make_layer(*shape, seed=hash(shape) % 1000 + 1)
    y = fused_moe(*layer, config=FUSED_SMALL)
    check_moe(y, *layer, reference.moe_expert_centric)


def test_default_configs_run_at_small_shapes():
    layer = make_layer(3, 64, 48, 8, 2, seed=7)
    check_moe(warp_decode_moe(*layer), *layer, reference.moe_output_centric)
    check_moe(fused_moe(*layer), *layer, reference.moe_expert_centric)


def test_persistent_choice_only_at_the_batch_it_was_tuned_for(monkeypatch):
    """A table's one-launch choice goes with the tiles it was timed with: a batch whose nearest
    tiles come from a batch the tuner never timed as one launch runs the pair."""
    from kernels import tuned
    from kernels.warp_decode import default_configs

    tiles = {str(b): {"num_warps": 4, "block": b} for b in (1, 8, 64)}
    table = {"gate_up": tiles, "down": tiles, "persistent": {"1": 0, "8": 4}}
    monkeypatch.setattr(tuned, "load", lambda name: table)
    assert default_configs(9, 64, 48, 8, 2)["persistent"] == 4
    assert default_configs(9, 64, 48, 8, 2)["down"] == tiles["8"]
    for batch in (1, 2, 40, 64):  # tuned for the pair, or never timed as one launch
        assert "persistent" not in default_configs(batch, 64, 48, 8, 2)


def test_int32_ids_accepted():
    x, w_gate_up, w_down, ids, weights = make_layer(3, 64, 48, 8, 2, seed=11)
    layer = (x, w_gate_up, w_down, ids.to(torch.int32), weights)
    check_moe(warp_decode_moe(*layer, config=WARP_SMALL), *layer, reference.moe_output_centric)
    check_moe(fused_moe(*layer, config=FUSED_SMALL), *layer, reference.moe_expert_centric)


@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m", [(3, 8, 2, 16), (37, 5, 3, 16), (9, 40, 4, 32)]
)
def test_align_groups_slots_by_expert(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    numel = ids.numel()
    sorted_slots, block_expert, rows_used = align_by_expert(ids, experts, block_m)
    used = int(rows_used)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = sorted_slots[:used].long()
    real = rows[rows < numel]
    assert sorted(real.tolist()) == list(range(numel)), "every slot exactly once"
    flat = ids.reshape(-1)
    for block in range(used // block_m):
        expert = int(block_expert[block])
        block_rows = rows[block * block_m : (block + 1) * block_m]
        mine = block_rows[block_rows < numel]
        assert (flat[mine] == expert).all()
        assert mine.tolist() == sorted(mine.tolist()), "stable within an expert"
    assert (block_expert[used // block_m :] == -1).all()
    assert (sorted_slots[used:] == numel).all()


@pytest.mark.parametrize(
    "tokens,experts,top_k,renorm", [(1, 8, 2, True), (5, 60, 6, True), (4, 10, 3, False)]
)
def test_router_matches_reference(tokens, experts, top_k, renorm):
    gen = torch.Generator().manual_seed(experts)
    x = torch.randn(tokens, 32, generator=gen).bfloat16()
    router = torch.randn(experts, 32, generator=gen).bfloat16()
    ids, weights = triton_route(x, router, top_k, renorm)
    ref_ids, ref_weights = reference.route(x, router, top_k, renorm)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_dispatch_cpu_uses_references():
    for tokens in (1, 8):
        layer = make_layer(tokens, 64, 48, 8, 2, seed=tokens + 20)
        y = dispatch.moe(*layer)
        check_moe(y, *layer, reference.moe_float64)
    x, _, _, _, _ = make_layer(2, 64, 48, 8, 2, seed=3)
    router = torch.randn(8, 64).bfloat16()
    ids, weights = dispatch.route(x, router, 2, True)
    ref_ids, ref_weights = reference.route(x, router, 2, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_dispatch_triton_paths_match_reference():
    layer = make_layer(3, 64, 48, 8, 2, seed=5)
    for path in (
        dispatch.WARP_DECODE,
        dispatch.WARP_DECODE_DEDUP,
        dispatch.WARP_DECODE_BATCHED,
        dispatch.EXPERT_CENTRIC,
    ):
        check_moe(dispatch.run_path(path, *layer), *layer, reference.moe_float64)


def test_choose_path_follows_crossover_table(monkeypatch):
    table = {
        "E128_k8": {
            "experts": 128,
            "slots_per_expert": 0.5,
            "winners": {
                "1": "warp_decode",
                "8": "warp_decode",
                "16": "expert_centric",
                "64": "warp_decode_batched",
            },
        },
        "E64_k16": {
            "experts": 64,
            "slots_per_expert": 0.5,
            "winners": {"2": "warp_decode", "8": "warp_decode_dedup"},
        },
    }
    monkeypatch.setattr(dispatch, "_table", lambda: table)
    assert dispatch.choose_path(1, 8, 128) == dispatch.WARP_DECODE
    assert dispatch.choose_path(9, 8, 128) == dispatch.WARP_DECODE
    assert dispatch.choose_path(20, 8, 128) == dispatch.EXPERT_CENTRIC
    assert dispatch.choose_path(64, 8, 128) == dispatch.WARP_DECODE_BATCHED
    assert dispatch.choose_path(65, 8, 128) == dispatch.EXPERT_CENTRIC  # past the token tile
    assert dispatch.choose_path(8, 16, 64) == dispatch.WARP_DECODE_DEDUP
    assert dispatch.choose_path(65, 16, 64) == dispatch.EXPERT_CENTRIC  # past the slot limit
    # Unmeasured (E, k): the slots-per-expert rule of the nearest measured E.
    assert dispatch.choose_path(4, 8, 256) == dispatch.WARP_DECODE
    assert dispatch.choose_path(64, 8, 256) == dispatch.EXPERT_CENTRIC
