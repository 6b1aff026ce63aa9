"""Block-scaled FP8 weights (engine/loading/fp8.py): quantization, quantization-aware training,
and the FP8 export read by the engine, by transformers and by the trainer's resume."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from checkpoints import engine_logits, max_rel, row_scaled_weights
from safetensors import safe_open
from tiny_training import EXPORT_BLOCK, EXPORT_TINY, TINY, export_fp8, tiny_model

from engine.loading.fp8 import (
    FP8,
    FP8_MAX,
    SCALE_SUFFIX,
    block_scales,
    dequantize,
    fake_quantize,
    quantize,
)
from engine.train.model import MOE_FORMS, Linear, Qwen3MoeLM

BLOCK = 32
# Every dim a multiple of the block; then neither dim one (ragged last blocks both ways).
SHAPES = [(64, 96), (130, 70)]
BLOCK2 = (BLOCK, BLOCK)  # as config.json's weight_block_size gives it to dequantize

_weights = row_scaled_weights


def _per_element(grid: torch.Tensor, shape, block: int) -> torch.Tensor:
    """A [ceil(out/B), ceil(in/B)] per-block grid spread over the [out, in] elements."""
    return grid.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def _reference_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """Dequantization with the block size given, not inferred from the shapes."""
    return q.float() * _per_element(scale_inv.float(), q.shape, block)


def _block_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block)
    padded = F.pad(w.abs(), (0, cols * block - w.shape[1], 0, rows * block - w.shape[0]))
    return padded.view(rows, block, cols, block).amax(dim=(1, 3))


def _is_power_of_two(x: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(x)
    return bool((mantissa == 0.5).all())


# --- quantize / dequantize -----------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_round_trip_within_fp8_tolerance(shape):
    w32 = _weights(shape)
    w = w32.to(torch.bfloat16).float()  # quantize starts from the bf16 value checkpoints keep
    q, s = quantize(w32, BLOCK)
    q16, s16 = quantize(w, BLOCK)
    assert torch.equal(q.view(torch.uint8), q16.view(torch.uint8)) and torch.equal(s, s16)
    grid = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
    assert q.dtype == FP8 and tuple(q.shape) == shape
    assert s.dtype == torch.float32 and tuple(s.shape) == grid
    assert torch.equal(s, block_scales(w, BLOCK))
    assert _is_power_of_two(s)
    # The smallest power of two that fits the block into the fp8 range: amax / scale in (224, 448].
    ratio = _block_amax(w, BLOCK) / s
    assert bool((ratio <= FP8_MAX).all()) and bool((ratio > FP8_MAX / 2).all()), ratio
    assert bool(q.float().isfinite().all())

    d = _reference_dequantize(q, s, BLOCK)
    scale = _per_element(s, shape, BLOCK)
    err = (d - w).abs()
    # e4m3 keeps 3 fraction bits: round-to-nearest is within 2**-4 relative for normal fp8 values,
    # and within half the subnormal step (2**-9 * scale) below them.
    normal = w.abs() >= scale * 2.0**-6
    assert normal.float().mean() > 0.99  # the bound below is the one that matters
    assert bool((err[normal] <= w.abs()[normal] * 2.0**-4).all()), (err / w.abs())[normal].max()
    assert bool((err[~normal] <= scale[~normal] * 2.0**-10).all())
    # In block-max terms: every value not tiny against its block max is within 2**-4 relative.
    not_tiny = w.abs() >= _per_element(_block_amax(w, BLOCK), shape, BLOCK) * 2.0**-13
    assert bool((err[not_tiny] <= w.abs()[not_tiny] * 2.0**-4).all())
    assert err.max() > 0  # a real rounding, not a degenerate comparison
    # A 4-bit significand times a power of two: exact in bf16.
    assert torch.equal(d.to(torch.bfloat16).float(), d)


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_applies_each_blocks_scale(shape):
    w = _weights(shape, seed=1)
    q, s = quantize(w, BLOCK)
    for dtype in (torch.float32, torch.bfloat16):
        d = dequantize(q, s, BLOCK2, dtype)
        assert d.dtype == dtype
        torch.testing.assert_close(d.float(), _reference_dequantize(q, s, BLOCK), rtol=0, atol=0)


def test_dequantize_takes_rows_then_columns_of_a_rectangular_block():
    """weight_block_size is [rows, cols]: element (i, j) takes the scale of block
    (i // rows, j // cols)."""
    g = torch.Generator().manual_seed(11)
    q = (torch.rand(130, 70, generator=g) * 400 - 200).to(FP8)
    s = torch.exp2(
        torch.randint(-12, -2, (9, 3), generator=g).float()
    )  # ceil(130 / 16), ceil(70 / 32)
    rows, cols = torch.arange(130)[:, None] // 16, torch.arange(70)[None, :] // 32
    assert torch.equal(dequantize(q, s, (16, 32)), q.float() * s[rows, cols])
    with pytest.raises(
        ValueError, match=r"blocks of 32x16 needs a scale grid \(5, 5\), got \(9, 3\)"
    ):
        dequantize(q, s, (32, 16))


def test_dequantize_rejects_a_grid_that_is_not_the_blocks_grid():
    q, s = quantize(_weights((64, 64)), BLOCK)
    assert torch.equal(dequantize(q, s, BLOCK2), _reference_dequantize(q, s, BLOCK))
    with pytest.raises(
        ValueError,
        match=r"\(64, 64\) in blocks of 32x32 needs a scale grid \(2, 2\), got \(33, 2\)",
    ):
        dequantize(q, torch.ones(33, 2), BLOCK2)  # no block size gives 33 row blocks of 64 rows
    with pytest.raises(ValueError, match=r"\(65, 2\)"):
        dequantize(q, torch.ones(65, 2), BLOCK2)  # more row blocks than rows
    with pytest.raises(ValueError, match=r"\(4, 4\)"):
        dequantize(
            q, torch.ones(4, 4), BLOCK2
        )  # block 16's grid: the config's block decides, not the grid
    with pytest.raises(ValueError, match=r"needs a scale grid \(2, 2\), got \(2,\)"):
        dequantize(q, torch.ones(2), BLOCK2)


def _with_a_block_that_rounds_down_to_half_range(shape):
    """Weights whose first block has amax / scale in (224, 232): fp8 rounds it to exactly 224."""
    w = _weights(shape, seed=2)
    w[:BLOCK, :BLOCK] = w[:BLOCK, :BLOCK].clamp(-0.5, 0.5)
    w[0, 0] = 228.0 / 256.0  # scale 2**-8 (amax/448 = 2**-8.97); 228 rounds to 224 (step 16)
    return w


@pytest.mark.parametrize("shape", SHAPES)
def test_requantizing_dequantized_weights_keeps_them(shape):
    """quantize(dequantize(quantize(w))) gives back the same weights, and the same bytes and
    scales in every block whose largest value did not round down to half the fp8 range. In those
    blocks (by design) the scale halves and every byte doubles: the same values, not the same
    bytes."""
    w = _with_a_block_that_rounds_down_to_half_range(shape)
    q, s = quantize(w, BLOCK)
    d = _reference_dequantize(q, s, BLOCK)
    q2, s2 = quantize(d, BLOCK)
    assert torch.equal(_reference_dequantize(q2, s2, BLOCK), d)
    assert torch.equal(dequantize(q2, s2, BLOCK2), d)
    full_range = _block_amax(q.float(), BLOCK) != FP8_MAX / 2
    assert full_range.any() and not full_range.all()  # both kinds of block are checked
    assert torch.equal(s2[full_range], s[full_range])
    assert torch.equal(s2[~full_range], s[~full_range] / 2)
    same = _per_element(full_range, shape, BLOCK)
    assert torch.equal(q2.view(torch.uint8)[same], q.view(torch.uint8)[same])
    assert torch.equal(q2.float()[~same], 2 * q.float()[~same])


def test_an_all_zero_block_gets_a_normal_scale():
    """Widened experts start with all-zero down_proj blocks: a subnormal scale there is flushed
    to 0 on a GPU, and 0 / 0 turned a whole training run into NaN."""
    from engine.loading.fp8 import block_scales, fake_quantize

    w = torch.zeros(128, 128)
    w[:64, :64] = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    scales = block_scales(w, 64)
    assert (scales >= torch.finfo(torch.float32).tiny).all()  # normal, so no flush-to-zero
    rounded = fake_quantize(w, 64)
    assert (
        torch.isfinite(rounded).all() and (rounded[64:] == 0).all() and (rounded[:, 64:] == 0).all()
    )


# --- fake quantization (straight-through) ---------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.enable_grad()
def test_fake_quantize_rounds_forward_and_passes_gradients_straight_through(shape, dtype):
    w = _weights(shape, seed=3).to(dtype).requires_grad_()
    out = fake_quantize(w, BLOCK)
    q, s = quantize(w.detach(), BLOCK)
    assert out.dtype == dtype
    assert torch.equal(out.detach().float(), _reference_dequantize(q, s, BLOCK))
    assert not torch.equal(out.detach(), w.detach())
    assert torch.equal(out.detach(), dequantize(q, s, BLOCK2, dtype))
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    out.backward(upstream)
    assert torch.equal(w.grad, upstream)


# --- quantization-aware training -----------------------------------------------------------


def _projections(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("moe", MOE_FORMS)
@torch.enable_grad()
def test_fp8_training_sees_the_dequantized_projections(moe):
    block = 16
    qat = tiny_model(seed=6, moe=moe)
    plain = tiny_model(seed=6, moe=moe)
    rounded = tiny_model(seed=6, moe=moe)
    projections = _projections(rounded)
    assert len(projections) == TINY["num_hidden_layers"] * (4 + 3 * TINY["num_experts"])
    with torch.no_grad():
        for m in projections.values():
            m.weight.copy_(dequantize(*quantize(m.weight, block), (block, block)))
    qat.set_fp8_training(block)
    assert all(m.fp8_block == block for m in _projections(qat).values())

    # Router and embedding stay in full precision: FP8 rounding would change them.
    for name, p in qat.named_parameters():
        if name.endswith("mlp.gate.weight") or name == "model.embed_tokens.weight":
            assert not isinstance(qat.get_submodule(name.rsplit(".", 1)[0]), Linear), name
            assert not torch.equal(fake_quantize(p.detach(), block), p.detach()), name

    ids = torch.randint(0, TINY["vocab_size"], (2, 15), generator=torch.Generator().manual_seed(7))
    got, got_aux = qat(ids)
    want, want_aux = rounded(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_aux, want_aux)
    with torch.no_grad():
        full, _ = plain(ids)
    assert (got - full).abs().max() > 1e-3  # the rounding is visible in the logits

    # Straight-through: the full-precision weights get the gradients of the rounded ones.
    for logits, aux in ((got, got_aux), (want, want_aux)):
        (F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * aux).backward()
    want_grads = dict(rounded.named_parameters())
    for name, p in qat.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)

    qat.set_fp8_training(None)
    with torch.no_grad():
        off, _ = qat(ids)
    torch.testing.assert_close(off, full, rtol=0, atol=0)


# --- FP8 export ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
    return export_fp8(tmp_path_factory.mktemp("fp8_export"), EXPORT_BLOCK)


@pytest.fixture(scope="module")
def ragged_fp8_export(tmp_path_factory):
    """Block 48 leaves ragged last blocks in the 64-wide dims (transformers would refuse it, the
    engine's reader takes it)."""
    return export_fp8(tmp_path_factory.mktemp("ragged_fp8_export"), 48)


EXPORTS = ["fp8_export", "ragged_fp8_export"]


def _block_of(model_dir):
    return tuple(
        json.loads((model_dir / "config.json").read_text())["quantization_config"][
            "weight_block_size"
        ]
    )


def test_fp8_export_layout(fp8_export):
    model, model_dir = fp8_export
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["moe_intermediate_size"] == 32 and cfg["hidden_size"] == 64
    quant = cfg["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [
        EXPORT_BLOCK,
        EXPORT_BLOCK,
    ]
    assert set(quant["modules_to_not_convert"]) >= {
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    }
    assert json.loads((model_dir / "training_state.json").read_text())["step"] == 3

    state = model.state_dict()
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        projections = {n for n in state if n.endswith("_proj.weight")}
        assert len(projections) == 2 * (4 + 3 * 4)
        assert names == set(state) | {n + SCALE_SUFFIX for n in projections}
        for name in sorted(state):
            t = f.get_tensor(name)
            if name in projections:
                s = f.get_tensor(name + SCALE_SUFFIX)
                assert t.dtype == FP8 and s.dtype == torch.float32, name
                assert tuple(s.shape) == tuple(math.ceil(n / EXPORT_BLOCK) for n in t.shape), name
                assert _is_power_of_two(s), name
                # What the QAT forward pass used, bit for bit.
                assert torch.equal(
                    dequantize(t, s, (EXPORT_BLOCK, EXPORT_BLOCK)),
                    fake_quantize(state[name], EXPORT_BLOCK),
                ), name
            else:  # embedding, router, norms
                assert t.dtype == torch.bfloat16, name
                assert torch.equal(t.float(), state[name]), name


def _ids():
    return torch.randint(
        0, EXPORT_TINY["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(10)
    )


def test_engine_loads_the_fp8_export_as_trained(fp8_export):
    model, model_dir = fp8_export
    ids = _ids()
    with torch.no_grad():
        trained, _ = model(ids)
    ours = engine_logits(model_dir, ids)
    assert trained.std() > 0.1
    assert max_rel(ours, trained) < 1e-4


def test_engine_loads_an_fp8_export_with_ragged_blocks_as_trained(ragged_fp8_export):
    """The engine must see the weights the QAT model trained with, ragged last blocks included."""
    model, model_dir = ragged_fp8_export
    assert _block_of(model_dir) == (48, 48)
    ids = _ids()
    with torch.no_grad():
        trained, _ = model(ids)
    assert max_rel(engine_logits(model_dir, ids), trained) < 1e-4


def test_transformers_loads_the_fp8_export_like_the_engine(fp8_export):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _, model_dir = fp8_export
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert max_rel(engine_logits(model_dir, ids), theirs) < 1e-4


@pytest.mark.parametrize("export", EXPORTS)
def test_qat_checkpoint_keeps_the_unrounded_weights(export, request):
    """checkpoint.save writes the weights in bf16 as they are, not rounded through FP8: a resumed
    run keeps the progress below the FP8 grid (rounding happens only in the forward pass)."""
    from engine.train import checkpoint

    model, model_dir = request.getfixturevalue(export)
    saved = checkpoint.load_weights(model_dir.parent / "run" / "ckpt")
    state = model.state_dict()
    assert saved.keys() == state.keys()
    projections = {name + ".weight" for name in _projections(model)}
    for name, t in saved.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, state[name].to(torch.bfloat16)), name
    assert any(
        not torch.equal(saved[n].float(), fake_quantize(state[n], _block_of(model_dir)[0]).detach())
        for n in projections
    )


@pytest.mark.parametrize("export", EXPORTS)
def test_fp8_export_of_a_qat_checkpoint_is_what_the_qat_forward_used(export, request):
    """Exported with the block it trained with, every projection dequantizes to the QAT forward's
    weight bit for bit: both round from the weight's bf16 value, so the bf16 checkpoint loses
    nothing."""
    model, model_dir = request.getfixturevalue(export)
    block = _block_of(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name, m in _projections(model).items():
            t, s = f.get_tensor(name + ".weight"), f.get_tensor(name + ".weight" + SCALE_SUFFIX)
            assert t.dtype == FP8, name
            trained = m.effective_weight().detach()
            assert torch.equal(dequantize(t, s, block), trained), name


@pytest.mark.parametrize("export", EXPORTS)
def test_resuming_from_an_fp8_export_reads_its_dequantized_weights(export, request):
    """checkpoint.load_weights on an exported FP8 folder: bf16 weights equal to the dequantized FP8
    ones, no `_scale_inv` keys; a QAT model loaded from them computes what the exported one did."""
    from engine.train import checkpoint

    model, model_dir = request.getfixturevalue(export)
    block = _block_of(model_dir)
    weights = checkpoint.load_weights(model_dir)
    assert weights.keys() == model.state_dict().keys()
    assert not any(k.endswith(SCALE_SUFFIX) for k in weights)
    n_fp8 = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name, t in weights.items():
            assert t.dtype == torch.bfloat16, name
            stored = f.get_tensor(name)
            if stored.dtype == FP8:
                n_fp8 += 1
                assert torch.equal(
                    t.float(), dequantize(stored, f.get_tensor(name + SCALE_SUFFIX), block)
                ), name
            else:
                assert torch.equal(t, stored), name
    assert n_fp8 == len(_projections(model))

    resumed = Qwen3MoeLM(EXPORT_TINY)
    resumed.load_state_dict({k: v.float() for k, v in weights.items()})
    resumed.set_fp8_training(block[0])
    resumed.eval()
    ids = _ids()
    with torch.no_grad():
        want, want_aux = model(ids)
        got, got_aux = resumed(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_aux, want_aux, rtol=0, atol=0)
