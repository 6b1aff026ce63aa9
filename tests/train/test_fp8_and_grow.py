"""Block-scaled FP8 weights (engine/loading/fp8.py), quantization-aware training, the FP8 export read by the
engine and by transformers, and widening the experts without changing the model's function."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from checkpoints import (
    engine_logits,
    max_rel,
    quantizable_training_config,
    row_scaled_weights,
    scaled_training_model,
)
from safetensors import safe_open

from engine.loading.fp8 import (
    FP8,
    FP8_MAX,
    SCALE_SUFFIX,
    block_scales,
    dequantize,
    fake_quantize,
    quantize,
)
from engine.train.config import CONFIG
from engine.train.grow import expert_width, widen_experts
from engine.train.model import Linear, Qwen3MoeLM

BLOCK = 32
SHAPES = [
    (64, 96),
    (130, 70),
]  # every dim a multiple of the block; neither dim one (ragged last blocks)
BLOCK2 = (BLOCK, BLOCK)  # as config.json's weight_block_size gives it to dequantize

# Projections 48x64, 32x48, 32x48 (experts), 48x32: all multiples of 16.
TINY = {
    **CONFIG,
    "vocab_size": 96,
    "hidden_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}

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


# --- quantize / dequantize -------------------------------------------------------------------------


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
    """weight_block_size is [rows, cols]: element (i, j) takes the scale of block (i // rows, j // cols)."""
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
    """quantize(dequantize(quantize(w))) gives back the same weights, and the same bytes and scales in
    every block whose largest value did not round down to half the fp8 range. In those blocks (by
    design) the scale halves and every byte doubles: the same values, not the same bytes."""
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


# --- fake quantization (straight-through) -----------------------------------------------------------


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


# --- widening the experts --------------------------------------------------------------------------


def _model(config=TINY, seed=0, dense=False):
    return scaled_training_model(config, seed, dense)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@torch.enable_grad()
def test_widened_experts_compute_the_same_function(dense):
    model = _model(dense=dense)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert expert_width(weights) == 32
    grown = widen_experts(weights, 48, std=0.5, seed=1)
    assert expert_width(grown) == 48
    wide = Qwen3MoeLM({**TINY, "moe_intermediate_size": 48}, dense_moe=dense)
    wide.load_state_dict(grown)  # strict: every name, every shape

    ids = torch.randint(0, TINY["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before, aux_before = model(ids)
    after, aux_after = wide(ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux_after, aux_before)
    assert before.std() > 0.1

    # The new units are live (their gate/up rows are random), so training can move their down columns.
    F.cross_entropy(after.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    new_down_grads = [
        m.down_proj.weight.grad[:, 32:] for layer in wide.model.layers for m in layer.mlp.experts
    ]
    assert sum(int(g.abs().sum() > 0) for g in new_down_grads) > len(new_down_grads) // 2


def test_widen_experts_layout():
    weights = {k: v.to(torch.bfloat16) for k, v in _model().state_dict().items()}
    grown = widen_experts(weights, 40, std=0.02, seed=3)
    assert grown.keys() == weights.keys()
    again = widen_experts(weights, 40, std=0.02, seed=3)
    for name, t in weights.items():
        g = grown[name]
        assert g.dtype == t.dtype, name
        if ".experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight")):
            assert g.shape == (40, 48)
            assert torch.equal(g[:32], t)
            assert g[32:].abs().min() > 0 and 0.01 < g[32:].float().std() < 0.03
            assert torch.equal(g, again[name])  # seeded
        elif ".experts." in name and name.endswith("down_proj.weight"):
            assert g.shape == (48, 40)
            assert torch.equal(g[:, :32], t)
            assert not g[:, 32:].any()
        else:
            assert g is t, name
    assert not torch.equal(
        widen_experts(weights, 40, std=0.02, seed=4)["model.layers.0.mlp.experts.0.up_proj.weight"],
        grown["model.layers.0.mlp.experts.0.up_proj.weight"],
    )
    same = widen_experts(weights, 32)
    assert all(torch.equal(same[k], v) for k, v in weights.items())


def test_narrowing_experts_is_refused_and_width_is_reported():
    weights = _model().state_dict()
    with pytest.raises(ValueError, match="from 32 to 16"):
        widen_experts(weights, 16)
    assert expert_width({"model.embed_tokens.weight": torch.zeros(4, 4)}) == 0


# --- quantization-aware training -------------------------------------------------------------------


def _projections(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@torch.enable_grad()
def test_fp8_training_sees_the_dequantized_projections(dense):
    block = 16
    qat = _model(seed=6, dense=dense)
    plain = _model(seed=6, dense=dense)
    rounded = _model(seed=6, dense=dense)
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
    for model, (logits, aux) in ((qat, (got, got_aux)), (rounded, (want, want_aux))):
        (F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * aux).backward()
    want_grads = dict(rounded.named_parameters())
    for name, p in qat.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)

    qat.set_fp8_training(None)
    with torch.no_grad():
        off, _ = qat(ids)
    torch.testing.assert_close(off, full, rtol=0, atol=0)


# --- FP8 export ------------------------------------------------------------------------------------

# Every projection dim a multiple of EXPORT_BLOCK, which transformers' FP8 loader needs:
# q/o 64x64, k/v 32x64, experts gate/up 32x64, down 64x32.
EXPORT_TINY = quantizable_training_config()
EXPORT_BLOCK = 32


def _export(root, block, config=EXPORT_TINY):
    """A QAT model saved by `checkpoint.save` (in root/run/ckpt) and exported through the CLI with
    --fp8-block; returns (model, model folder). The weights shipped in bf16 (embedding, router,
    norms) are made exact in bf16; the projections stay fp32 values that bf16 cannot hold, so a
    checkpoint that rounded them to bf16 before the export's FP8 rounding would show."""
    from engine.train import checkpoint, export

    model = _model(config, seed=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all 4.0, so the norms' gains are exercised
                p.copy_(4.0 + torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
            if not name.endswith("_proj.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    model.set_fp8_training(block)
    model.eval()
    state = {"step": 3, "tokens_seen": 100, "train_seconds": 1.5, "runs": []}
    checkpoint.save(model, state, root / "run" / "ckpt")
    model_dir = root / "model"
    mp = pytest.MonkeyPatch()
    mp.setattr(export, "CONFIG", config)
    try:
        export.main(
            [
                "--ckpt",
                str(root / "run" / "ckpt"),
                "--model-dir",
                str(model_dir),
                "--fp8-block",
                str(block),
            ]
        )
    finally:
        mp.undo()
    return model, model_dir


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("fp8_export"), EXPORT_BLOCK)


@pytest.fixture(scope="module")
def ragged_fp8_export(tmp_path_factory):
    """Block 48 leaves ragged last blocks in the 64-wide dims (transformers would refuse it, the
    engine's reader takes it)."""
    return _export(tmp_path_factory.mktemp("ragged_fp8_export"), 48)


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
    weight bit for bit: both round from the weight's bf16 value, so the bf16 checkpoint loses nothing."""
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


def _resume_one_step(tmp_path, monkeypatch, *grow_args):
    """`train --resume FP8_EXPORT GROW_ARGS --fp8-block 32`, one step at lr 0 on the CPU (so the step
    changes nothing); returns the exported model, its folder (also the run's --model-dir), its
    config and the run's output folder."""
    from checkpoints import TRAINING_TEXT, build_tokenizer

    from engine.train import plot, train

    tok = build_tokenizer()
    config = {**EXPORT_TINY, "vocab_size": tok.get_vocab_size()}
    model, model_dir = _export(tmp_path, EXPORT_BLOCK, config)
    tok.save(str(model_dir / "tokenizer.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = sorted(set(TRAINING_TEXT))
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": d * 3}) + "\n" for d in docs))
    (corpus / "heldout.jsonl").write_text("".join(json.dumps({"text": d * 4}) + "\n" for d in docs))
    monkeypatch.setattr(plot, "plot_loss", lambda *a: None)  # matplotlib is slow to import
    out = tmp_path / "out"
    train.main(
        [
            "--corpus",
            str(corpus),
            "--model-dir",
            str(model_dir),
            "--out",
            str(out),
            "--resume",
            str(model_dir),
            *grow_args,
            "--fp8-block",
            str(EXPORT_BLOCK),
            "--workers",
            "0",
            "--max-steps",
            "1",
            "--device",
            "cpu",
            "--moe",
            "sparse",
            "--compile",
            "off",
            "--seq-len",
            "32",
            "--batch-rows",
            "2",
            "--micro-rows",
            "2",
            "--heldout-rows",
            "2",
            "--lr",
            "0",
            "--warmup-steps",
            "1",
            "--log-every",
            "1",
        ]
    )
    return model, model_dir, config, out


def test_training_resumes_from_an_fp8_export_with_wider_experts(tmp_path, monkeypatch):
    """`train --resume FP8_EXPORT --widen-experts 64 --fp8-block 32`, one step on the CPU: with lr 0
    the step changes nothing, so the saved checkpoint is exactly the export's weights, widened, and
    computes the exported model's function."""
    from engine.train import checkpoint

    model, model_dir, config, out = _resume_one_step(tmp_path, monkeypatch, "--widen-experts", "64")

    state = checkpoint.load_state(out / "ckpt")
    assert state["step"] == 4
    assert (
        state["runs"][-1]["widened_experts"] == [32, 64]
        and state["runs"][-1]["fp8_block"] == EXPORT_BLOCK
    )
    assert state["runs"][-1]["start_step"] == 3 and state["runs"][-1]["end_step"] == 4
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    step = next(r for r in log if r.get("step") == 4 and "loss" in r)
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0  # a real forward and backward
    assert math.isfinite(log[-1]["heldout_loss"]) and log[-1]["final"]

    saved = checkpoint.load_weights(out / "ckpt")
    exported = checkpoint.load_weights(model_dir)
    assert expert_width(saved) == 64 and saved.keys() == exported.keys()
    for name, t in saved.items():
        old = exported[name]
        if name.endswith(("gate_proj.weight", "up_proj.weight")) and ".experts." in name:
            assert t.shape == (64, 64) and torch.equal(t[:32], old), name
            assert t[32:].abs().max() > 0, name  # live new units
        elif name.endswith("down_proj.weight") and ".experts." in name:
            assert t.shape == (64, 64) and torch.equal(t[:, :32], old) and not t[:, 32:].any(), name
        else:
            assert torch.equal(t, old), name

    wide = Qwen3MoeLM({**config, "moe_intermediate_size": 64})
    wide.load_state_dict({k: v.float() for k, v in saved.items()})
    wide.set_fp8_training(EXPORT_BLOCK)
    ids = torch.randint(
        0, config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(12)
    )
    with torch.no_grad():
        want, _ = model(ids)
        got, _ = wide(ids)
    assert want.std() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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


def test_export_writes_the_expert_width_the_checkpoint_has(tmp_path, monkeypatch):
    """A widened run's checkpoint exports with its own moe_intermediate_size, not CONFIG's."""
    from engine.loading.loader import load_model
    from engine.train import checkpoint, export

    wide = {**EXPORT_TINY, "moe_intermediate_size": EXPORT_TINY["moe_intermediate_size"] * 2}
    model = _model(wide, seed=11)
    checkpoint.save(
        model, {"step": 1, "tokens_seen": 1, "train_seconds": 0.0, "runs": []}, tmp_path / "ckpt"
    )
    monkeypatch.setattr(export, "CONFIG", EXPORT_TINY)
    export.export(tmp_path / "ckpt", tmp_path / "model")
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert written["moe_intermediate_size"] == wide["moe_intermediate_size"]
    assert (
        load_model(tmp_path / "model").layers[0].w_down.shape[-1] == wide["moe_intermediate_size"]
    )


# --- adding experts --------------------------------------------------------------------------------


def test_router_loads_count_every_top_k_slot():
    from engine.train.grow import router_loads

    model = _model()
    ids = torch.randint(0, TINY["vocab_size"], (5, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loads = router_loads(model, ids, batch=2)
    assert loads.shape == (2, 8)
    assert (loads.sum(1) == 5 * 11 * 2).all()  # every token's two slots, in every layer
    # Layer 0's router sees the first layer's post-attention norm of the embeddings.
    with torch.no_grad():
        layer = model.model.layers[0]
        x = model.model.embed_tokens(ids)
        from engine.train.model import rope_cos_sin

        cos, sin = rope_cos_sin(torch.arange(11), TINY["head_dim"], TINY["rope_theta"])
        h = layer.post_attention_layernorm(x + layer.self_attn(layer.input_layernorm(x), cos, sin))
        _, top_i, _ = layer.mlp.route(h.reshape(-1, TINY["hidden_size"]))
    assert torch.equal(loads[0], torch.bincount(top_i.flatten(), minlength=8))


def test_added_experts_copy_the_busiest_with_near_zero_router_rows():
    from engine.train.grow import add_experts, expert_count

    weights = {k: v.to(torch.bfloat16) for k, v in _model().state_dict().items()}
    loads = torch.tensor([[5, 9, 1, 7, 3, 8, 2, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
    grown = add_experts(weights, 12, loads, router_std=1e-3, seed=3)
    assert expert_count(weights) == 8 and expert_count(grown) == 12
    assert set(weights) < set(grown) and len(grown) == len(weights) + 2 * 4 * 3
    for layer, busiest in ((0, [1, 5, 3, 0]), (1, [7, 6, 5, 4])):
        prefix = f"model.layers.{layer}.mlp"
        router = grown[f"{prefix}.gate.weight"]
        assert router.shape == (12, 48) and router.dtype == torch.bfloat16
        assert torch.equal(router[:8], weights[f"{prefix}.gate.weight"])
        assert router[8:].abs().max() > 0 and router[8:].float().std() < 2e-3
        for j, source in enumerate(busiest):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(
                    grown[f"{prefix}.experts.{8 + j}.{proj}.weight"],
                    weights[f"{prefix}.experts.{source}.{proj}.weight"],
                )
    for name, t in weights.items():
        assert name.endswith("gate.weight") or grown[name] is t, name
    again = add_experts(weights, 12, loads, router_std=1e-3, seed=3)
    assert torch.equal(
        again["model.layers.0.mlp.gate.weight"], grown["model.layers.0.mlp.gate.weight"]
    )
    # More new experts than old ones: the copies go round the busiest again.
    many = add_experts(weights, 19, loads)
    assert torch.equal(
        many["model.layers.1.mlp.experts.16.up_proj.weight"],
        weights["model.layers.1.mlp.experts.7.up_proj.weight"],
    )
    with pytest.raises(ValueError, match="cannot drop experts"):
        add_experts(weights, 6, loads)


def test_added_experts_leave_tokens_whose_top_k_logits_are_positive_unchanged():
    """With zero router rows, a new expert's logit is 0: it takes a slot only from a token whose
    second-best logit is negative. A one-layer model, so a token's MoE routing decides alone
    whether its logits can change."""
    from engine.train.grow import add_experts, router_loads

    config = {**TINY, "num_hidden_layers": 1}
    model = _model(config, seed=4)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, TINY["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(6))
    seen = []
    with torch.no_grad():
        loads = router_loads(model, ids)
        hook = model.model.layers[0].mlp.gate.register_forward_hook(
            lambda m, i, out: seen.append(out)
        )
        before, _ = model(ids)
    hook.remove()
    second_best = torch.cat(seen).topk(2, dim=-1).values[:, 1].reshape(4, 16)

    grown = Qwen3MoeLM({**config, "num_experts": 12})
    grown.load_state_dict(add_experts(weights, 12, loads, router_std=0.0))
    with torch.no_grad():
        after, _ = grown(ids)
    kept = second_best > 0
    assert kept.float().mean() > 0.5 and (~kept).any()
    assert before.std() > 0.1
    torch.testing.assert_close(after[kept], before[kept], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after[~kept], before[~kept], rtol=1e-3, atol=1e-3)


def test_training_resumes_from_an_fp8_export_with_more_experts(tmp_path, monkeypatch):
    """`train --resume FP8_EXPORT --add-experts 6`, one step at lr 0 on the CPU: the checkpoint holds
    the export's weights and two copies of experts per layer; its export says 6 experts, and the
    engine loads it."""
    from engine.loading.loader import load_model
    from engine.train import checkpoint, export
    from engine.train.grow import expert_count

    _, model_dir, config, out = _resume_one_step(tmp_path, monkeypatch, "--add-experts", "6")

    state = checkpoint.load_state(out / "ckpt")
    assert state["runs"][-1]["added_experts"] == [4, 6]
    saved, exported = checkpoint.load_weights(out / "ckpt"), checkpoint.load_weights(model_dir)
    assert expert_count(saved) == 6 and set(exported) < set(saved)
    for name, t in exported.items():
        if name.endswith("mlp.gate.weight"):
            assert torch.equal(saved[name][:4], t) and saved[name].shape[0] == 6, name
        else:
            assert torch.equal(saved[name], t), name
    for layer in range(2):  # each new expert is one of the old ones
        for new in (4, 5):
            up = saved[f"model.layers.{layer}.mlp.experts.{new}.up_proj.weight"]
            assert any(
                torch.equal(up, exported[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"])
                for e in range(4)
            )

    monkeypatch.setattr(export, "CONFIG", config)
    export.export(out / "ckpt", tmp_path / "grown", EXPORT_BLOCK)
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["num_experts"] == 6
    assert load_model(tmp_path / "grown").layers[0].w_down.shape[0] == 6


@pytest.mark.parametrize(
    "grow_args, refusal",
    [
        (["--widen-experts", "16"], "--widen-experts 16 is narrower than the experts \\(32\\)"),
        (["--add-experts", "3"], "--add-experts 3 is fewer than the experts \\(4\\)"),
    ],
)
def test_training_refuses_to_shrink_the_experts(tmp_path, grow_args, refusal):
    """A checkpoint's experts (4 of them, 32 wide here) can grow, never shrink: a smaller size or
    count is refused before any data is read."""
    from checkpoints import build_tokenizer

    from engine.train import train

    tok = build_tokenizer()
    _, model_dir = _export(
        tmp_path, EXPORT_BLOCK, {**EXPORT_TINY, "vocab_size": tok.get_vocab_size()}
    )
    tok.save(str(model_dir / "tokenizer.json"))
    with pytest.raises(SystemExit, match=refusal):
        train.main(
            [
                "--corpus",
                str(tmp_path / "no-corpus"),
                "--model-dir",
                str(model_dir),
                "--out",
                str(tmp_path / "out"),
                "--resume",
                str(model_dir),
                *grow_args,
                "--device",
                "cpu",
                "--workers",
                "0",
            ]
        )
