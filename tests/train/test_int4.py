"""Group-scaled int4 weights (engine/loading/int4.py): the quantizer, compressed-tensors'
pack-quantized layout, training through int4 rounding, the int4 export read by the engine, by the
trainer's resume and by transformers."""

import json

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

from engine.loading import int4
from engine.model.config import ModelFormatError
from engine.train.model import MOE_FORMS, Qwen3MoeLM

GROUP = 16
TINY = quantizable_training_config()
_weights = row_scaled_weights


def _significant_bits(x: torch.Tensor) -> int:
    mantissa, _ = torch.frexp(x.double())  # in [0.5, 1)
    bits = 0
    while not torch.equal(mantissa * 2**bits, torch.round(mantissa * 2**bits)):
        bits += 1
    return bits


def _reference_pack(q: torch.Tensor) -> torch.Tensor:
    """The layout spelled out: word k of a row holds columns 8k..8k+7, column 8k+j at bits 4j, each
    as q + 8; the word read as a signed int32."""
    rows, cols = q.shape
    out = torch.empty(rows, cols // 8, dtype=torch.int32)
    for r in range(rows):
        for k in range(cols // 8):
            word = sum((int(q[r, 8 * k + j]) + 8) << (4 * j) for j in range(8))
            out[r, k] = word - (1 << 32) if word >= 1 << 31 else word
    return out


# --- quantize / pack ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(24, 64), (7, 32)])
def test_quantize_round_trip_within_int4_tolerance(shape):
    w = _weights(shape)
    q, scale = int4.quantize(w, GROUP)
    assert q.dtype == torch.int8 and q.abs().max() <= int4.Q_MAX and q.abs().max() == int4.Q_MAX
    assert scale.shape == (shape[0], shape[1] // GROUP)
    back = (q.float().unflatten(1, (-1, GROUP)) * scale[..., None]).flatten(1)
    w16 = w.to(torch.bfloat16).float()
    # Half a step of the group's grid at most; the step is the group's amax / 7, moved by <= 1/16.
    step = scale.repeat_interleave(GROUP, 1)
    assert ((back - w16).abs() <= step / 2).all()
    amax = w16.unflatten(1, (-1, GROUP)).abs().amax(2)
    assert (scale >= amax / int4.Q_MAX * 15 / 16).all() and (
        scale <= amax / int4.Q_MAX * 17 / 16
    ).all()
    # Every group's largest magnitude is +-7, so dequantized weights quantize to themselves.
    assert torch.equal(
        q.abs().unflatten(1, (-1, GROUP)).amax(2), torch.full_like(scale, 7, dtype=torch.int8)
    )
    assert torch.equal(int4.quantize(back, GROUP)[0], q) and torch.equal(
        int4.quantize(back, GROUP)[1], scale
    )


def test_scales_have_four_significant_bits_so_products_are_exact_in_bf16():
    w = _weights((32, 128), seed=1)
    q, scale = int4.quantize(w, GROUP)
    assert _significant_bits(scale) <= int4.SCALE_BITS
    products = q.float().unflatten(1, (-1, GROUP)) * scale[..., None]
    assert torch.equal(products.to(torch.bfloat16).float(), products)
    assert torch.equal(scale.to(torch.bfloat16).float(), scale)


def test_pack_matches_the_formats_layout_and_unpack_inverts_it():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (5, 48), generator=g, dtype=torch.int8)
    q[0, :8] = torch.tensor(
        [-8, 7, -1, 0, 1, -7, 6, 7], dtype=torch.int8
    )  # the top nibble's sign bit set
    packed = int4.pack(q)
    assert packed.dtype == torch.int32 and torch.equal(packed, _reference_pack(q))
    assert torch.equal(int4.unpack(packed, q.shape), q)


def test_pack_agrees_with_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q, _ = int4.quantize(_weights((16, 64), seed=3), GROUP)
    packed = int4.pack(q)
    assert torch.equal(packed, helpers.pack_to_int32(q, 4))
    assert torch.equal(helpers.unpack_from_int32(packed, 4, q.shape), q)


def test_an_all_zero_group_stays_zero_with_a_normal_scale():
    w = _weights((4, 64))
    w[1, 16:32] = 0  # as widened experts' down_proj columns start
    q, scale = int4.quantize(w, GROUP)
    assert not q[1, 16:32].any() and scale[1, 1] > 0 and torch.isfinite(scale).all()
    assert not int4.dequantize(int4.pack(q), scale, w.shape)[1, 16:32].any()


@pytest.mark.parametrize("bad", [dict(shape=(8, 40)), dict(group=12), dict(group=0)])
def test_quantize_refuses_shapes_the_groups_do_not_divide(bad):
    with pytest.raises(ValueError, match="int4"):
        int4.quantize(torch.ones(bad.get("shape", (8, 64))), bad.get("group", GROUP))


def test_dequantize_refuses_bad_scales_and_packing():
    q, scale = int4.quantize(_weights((8, 64)), GROUP)
    packed = int4.pack(q)
    with pytest.raises(ValueError, match="scale"):
        int4.dequantize(packed, scale[:, :3], (8, 64))
    bad = scale.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        int4.dequantize(packed, bad, (8, 64))
    with pytest.raises(ValueError, match="packed"):
        int4.dequantize(packed[:, :4], scale, (8, 64))
    with pytest.raises(ValueError, match="packed"):
        int4.dequantize(packed.to(torch.int64), scale, (8, 64))


def test_a_strided_packed_view_reads_as_its_values():
    q, scale = int4.quantize(_weights((8, 64), seed=4), GROUP)
    wide = (
        torch.cat([int4.pack(q), int4.pack(q)], dim=0).t().contiguous().t()
    )  # [16, 8], column-major
    assert not wide.is_contiguous()
    assert torch.equal(int4.unpack(wide[:8], (8, 64)), q)


def test_integer_scales_are_refused():
    q, scale = int4.quantize(_weights((8, 64)), GROUP)
    with pytest.raises(ValueError, match="floating point"):
        int4.dequantize(int4.pack(q), scale.to(torch.int32), (8, 64))


@torch.enable_grad()
def test_fake_quantize_rounds_forward_and_passes_gradients_straight_through():
    w = _weights((16, 64)).requires_grad_()
    q, scale = int4.quantize(w, GROUP)
    out = int4.fake_quantize(w, GROUP)
    assert torch.equal(out.detach(), int4.dequantize(int4.pack(q), scale, w.shape))
    grad = torch.randn(w.shape)
    out.backward(grad)
    assert torch.equal(w.grad, grad)


# --- the config -----------------------------------------------------------------------------------


def test_group_size_comes_from_the_compressed_tensors_config():
    assert (
        int4.config_group_size({"quantization_config": int4.quantization_config(32, ["lm_head"])})
        == 32
    )
    assert int4.config_group_size({}) is None
    assert int4.config_group_size({"quantization_config": {"quant_method": "fp8"}}) is None


@pytest.mark.parametrize(
    "change",
    [
        {"num_bits": 8},
        {"symmetric": False},
        {"strategy": "channel"},
        {"type": "float"},
        {"group_size": 0},
        {"dynamic": True},
    ],
)
def test_other_compressed_tensors_schemes_are_refused(change):
    quant = int4.quantization_config(32, [])
    quant["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(ValueError, match="compressed-tensors"):
        int4.config_group_size({"quantization_config": quant})


@pytest.mark.parametrize(
    "change",
    [
        {"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}},  # rotated weights
        {"kv_cache_scheme": {"num_bits": 8, "type": "float"}},
        {
            "quantization_status": "frozen"
        },  # plain weights that transformers would round in each forward
        {"config_groups": {"W4A16": ["Linear"]}},  # a preset's name, not a spelled-out scheme
        {"config_groups": [{"weights": {}}]},
        {"config_groups": {"group_0": None}},
        {"config_groups": {}},
    ],
)
def test_compressed_tensors_configs_beyond_weight_only_int4_are_refused(change):
    quant = {**int4.quantization_config(32, []), **change}
    with pytest.raises(ValueError, match="compressed-tensors"):
        int4.config_group_size({"quantization_config": quant})


def test_a_scheme_leaving_symmetric_and_strategy_to_their_defaults_is_read():
    quant = int4.quantization_config(128, [])
    for key in ("symmetric", "strategy", "type"):
        del quant["config_groups"]["group_0"]["weights"][key]
    assert int4.config_group_size({"quantization_config": quant}) == 128


# --- training through int4 and the export ---------------------------------------------------------


def _model(config=TINY, seed=0, moe="sparse"):
    return scaled_training_model(config, seed, moe)


def _ids():
    return torch.randint(
        0, TINY["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(10)
    )


@pytest.mark.parametrize("moe", MOE_FORMS)
def test_int4_training_sees_the_rounded_projections(moe):
    qat, plain = _model(seed=6, moe=moe), _model(seed=6, moe=moe)
    qat.set_int4_training(GROUP)
    ids = _ids()
    with torch.no_grad():
        got, _ = qat(ids)
        full, _ = plain(ids)
        for name, m in plain.named_modules():
            if name.endswith("_proj"):
                m.weight.copy_(int4.fake_quantize(m.weight, GROUP))
        want, _ = plain(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - full).abs().max() > 1e-3  # the rounding shows in the logits
    # The router stays in full precision.
    assert not hasattr(qat.model.layers[0].mlp.gate, "int4_group")


def _export(root, group: int = GROUP):
    """A QAT model saved by `checkpoint.save` and exported through the CLI with --int4-group."""
    from engine.train import checkpoint, export

    model = _model(seed=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(4.0 + torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
            if not name.endswith("_proj.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    model.set_int4_training(group)
    model.eval()
    checkpoint.save(
        model,
        {"step": 3, "tokens_seen": 100, "train_seconds": 1.5, "runs": []},
        root / "run" / "ckpt",
    )
    model_dir = root / "model"
    mp = pytest.MonkeyPatch()
    mp.setattr(export, "CONFIG", TINY)
    try:
        export.main(
            [
                "--ckpt",
                str(root / "run" / "ckpt"),
                "--model-dir",
                str(model_dir),
                "--int4-group",
                str(group),
            ]
        )
    finally:
        mp.undo()
    return model, model_dir


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("int4_export"))


def test_int4_export_layout(int4_export):
    model, model_dir = int4_export
    cfg = json.loads((model_dir / "config.json").read_text())
    assert int4.config_group_size(cfg) == GROUP
    assert set(cfg["quantization_config"]["ignore"]) == {
        "lm_head",
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    }
    state = model.state_dict()
    projections = {n for n in state if n.endswith("_proj.weight")}
    assert len(projections) == 2 * (4 + 3 * 4)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == (set(state) - projections) | {
            n + s for n in projections for s in int4.SUFFIXES
        }
        for name in sorted(state):
            if name in projections:
                packed, scale, shape = (f.get_tensor(name + s) for s in int4.SUFFIXES)
                assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16, name
                assert shape.tolist() == list(state[name].shape), name
                # What the QAT forward pass used, bit for bit.
                assert torch.equal(
                    int4.dequantize(packed, scale, shape.tolist()),
                    int4.fake_quantize(state[name], GROUP),
                ), name
            else:
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16 and torch.equal(t.float(), state[name]), name


def test_engine_loads_the_int4_export_as_trained(int4_export):
    model, model_dir = int4_export
    ids = _ids()
    with torch.no_grad():
        trained, _ = model(ids)
    assert trained.std() > 0.1
    assert max_rel(engine_logits(model_dir, ids), trained) < 1e-4


def _dequantized_gate_up(model_dir, layer):
    from engine.train import checkpoint

    w = checkpoint.load_weights(model_dir)
    p = f"model.layers.{layer}.mlp.experts."
    return torch.stack(
        [
            torch.cat([w[f"{p}{e}.gate_proj.weight"], w[f"{p}{e}.up_proj.weight"]]).float()
            for e in range(TINY["num_experts"])
        ]
    )


def test_transformers_loads_the_int4_export_like_the_engine(int4_export):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    _, model_dir = int4_export
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Dequantized at load, the fused experts (not Linear modules) keep the scales' dtype, bf16, and
    # so would compute in bf16 whatever dtype was asked; their values are exact in bf16, so fp32
    # copies are the shipped weights.
    experts = hf.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(experts.float(), _dequantized_gate_up(model_dir, 0))
    for p in hf.parameters():  # transformers refuses .float() on a quantized model
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert theirs.std() > 0.1
    assert max_rel(engine_logits(model_dir, ids), theirs) < 1e-4


def test_resuming_from_an_int4_export_reads_its_dequantized_weights(int4_export):
    from engine.train import checkpoint

    model, model_dir = int4_export
    weights = checkpoint.load_weights(model_dir)
    assert weights.keys() == model.state_dict().keys()
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    resumed = Qwen3MoeLM(TINY)
    resumed.load_state_dict({k: v.float() for k, v in weights.items()})
    resumed.set_int4_training(GROUP)
    resumed.eval()
    ids = _ids()
    with torch.no_grad():
        want, _ = model(ids)
        got, _ = resumed(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _broken_copy(int4_export, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    _, model_dir = int4_export
    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        (folder / name).write_text((model_dir / name).read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors, folder)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


NAME = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t, f: t.pop(NAME + "_scale"), "weight_scale"),
        (
            lambda t, f: t.update({NAME + "_shape": torch.tensor([64, 32], dtype=torch.int32)}),
            "shape",
        ),
        (
            lambda t, f: t.update({NAME + "_scale": t[NAME + "_scale"][:, :2].contiguous()}),
            "groups",
        ),
        (
            lambda t, f: t.update({NAME + "_g_idx": torch.zeros(64, dtype=torch.int32)}),
            "activation order",
        ),
        (
            lambda t, f: t.update({NAME + "_shape": torch.tensor(64, dtype=torch.int32)}),
            "two integers",
        ),
        (
            lambda t, f: t.update({NAME + "_shape": torch.tensor([[64, 64]], dtype=torch.int32)}),
            "two integers",
        ),
        (lambda t, f: t.update({NAME + "_shape": torch.tensor([64.0, 64.0])}), "two integers"),
        (
            lambda t, f: t.update({NAME + "_scale": t[NAME + "_scale"].to(torch.int32)}),
            "floating point",
        ),
        (
            lambda t, f: t.update({NAME + "_scale": torch.zeros_like(t[NAME + "_scale"])}),
            "positive",
        ),
        (lambda t, f: t.update({NAME + "_scale": -t[NAME + "_scale"]}), "positive"),
        (
            lambda t, f: t.update({NAME + "_packed": t[NAME + "_packed"].to(torch.int64)}),
            "packed int32",
        ),
        (
            lambda t, f: t.update({NAME: torch.zeros(64, 64, dtype=torch.bfloat16)}),
            "both plain and as int4",
        ),
        (
            lambda t, f: (f / "config.json").write_text(
                json.dumps(
                    {
                        k: v
                        for k, v in json.loads((f / "config.json").read_text()).items()
                        if k != "quantization_config"
                    }
                )
            ),
            "no compressed-tensors",
        ),
    ],
)
def test_a_broken_int4_checkpoint_is_named_not_crashed(int4_export, tmp_path, edit, message):
    from engine.loading.loader import load_model

    with pytest.raises(ModelFormatError, match=message):
        load_model(_broken_copy(int4_export, tmp_path, edit))


def test_training_step_through_int4_moves_the_weights():
    """One optimizer step of a QAT model: the loss is finite and the full-precision weights move."""
    model = _model(seed=11)
    model.set_int4_training(GROUP)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = _ids()
    with torch.enable_grad():
        logits, aux = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * aux
        loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, before
    )


def test_a_checkpoint_compressed_by_compressed_tensors_reads_as_its_decompression(tmp_path):
    """Weights written by compressed-tensors' own compressor (group 128, bf16 scales, an int64
    shape, -8 among the values) read back as the library decompresses them."""
    from safetensors.torch import save_file

    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from engine.loading.checkpoint_reader import CheckpointReader

    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=128
    )
    w = row_scaled_weights((256, 512), seed=5).to(torch.bfloat16)
    # The library's symmetric scales: amax / 7.5, so the largest values round to -8.
    amax = w.float().unflatten(1, (-1, 128)).abs().amax(2)
    scale = (amax / 7.5).to(torch.bfloat16)
    state = {
        "weight": w,
        "weight_scale": scale,
        "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8),
    }
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressed = PackedQuantizationCompressor.compress(dict(state), scheme=scheme)
    expected = PackedQuantizationCompressor.decompress(dict(compressed), scheme=scheme)["weight"]
    assert int4.unpack(compressed["weight_packed"], (256, 512)).min() == -8
    save_file(
        {f"x.{k}": v.contiguous() for k, v in compressed.items()},
        str(tmp_path / "model.safetensors"),
    )
    reader = CheckpointReader(tmp_path, int4_group=128)
    # The library forms q * scale in bf16; asked for bf16 the reader gives the same, and in fp32
    # it keeps the products exact (this scale has all 8 bits, so some products round in bf16).
    assert torch.equal(reader.get("x.weight", (256, 512), torch.bfloat16), expected)
    got = reader.get("x.weight", (256, 512), torch.float32)
    assert torch.equal(got.to(torch.bfloat16), expected) and not torch.equal(got, expected.float())


def test_training_refuses_two_formats_and_a_bad_group():
    from engine.train.train import parse_args

    base = ["--model-dir", "m", "--out", "o", "--device", "cpu"]
    for bad in (
        ["--fp8-block", "64", "--int4-group", "32"],
        ["--int4-group", "12"],
        ["--int4-group", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(base + bad)
    assert parse_args(base + ["--int4-group", "32"]).int4_group == 32


def test_the_cpu_decode_step_streams_an_int4_export_as_it_is(tmp_path_factory):
    """A model trained through int4 groups of 32 and exported: the engine's CPU decode step takes
    the int4 form by default (it holds the trained weights exactly), and its greedy tokens are the
    model's own (the general path's fp32 arithmetic on the same weights), from a prompt the
    general path computed."""
    from engine.loading.loader import load_model

    _, model_dir = _export(tmp_path_factory.mktemp("int4_export_32"), group=32)
    model = load_model(model_dir)
    assert model.lean.form == "int4" and model.lean.group == 32
    general = model.with_options(lean_decode=False)
    prompt = _ids()[:1, :6]
    tokens = {}
    for name, m in (("lean", model), ("general", general)):
        cache = m.new_cache(1)
        # A six-token prompt would take the lean forward too: the general path computes it.
        logits = general.forward(prompt, torch.arange(6)[None], cache)[0, -1]
        out = []
        for pos in range(6, 14):
            out.append(int(logits.argmax()))
            logits = m.forward(torch.tensor([[out[-1]]]), torch.tensor([[pos]]), cache)[0, -1]
        tokens[name] = out
    assert tokens["lean"] == tokens["general"]
    assert type(model.lean.layers[0].w_qkv).__name__ == "Int4Matrix"
