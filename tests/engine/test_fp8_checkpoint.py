"""Block-scaled FP8 checkpoints: weights come back dequantized, and broken ones give errors that
name the tensor (or the quantization method) at fault."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.checkpoint_reader import CheckpointReader
from engine.loading.fp8 import FP8, SCALE_SUFFIX, block_size, dequantize, quantize
from engine.loading.loader import load_model
from engine.model.config import ModelConfig, ModelFormatError

NAME = "model.layers.0.self_attn.q_proj.weight"
OTHER = "model.layers.0.input_layernorm.weight"


def _weights(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 0.02 * torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))


def _reference_dequantize(q, scale_inv, block):
    """With the block size given, not inferred from the shapes."""
    out_f, in_f = q.shape
    scale = scale_inv.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return q.float() * scale


def _reader(tmp_path, tensors, fp8_block=(32, 32)):
    """`fp8_block`: what the loader passes from config.json's weight_block_size (None: not fp8)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return CheckpointReader(tmp_path, fp8_block)


def test_fp8_weight_comes_back_dequantized_in_the_asked_dtype(tmp_path):
    w = _weights((64, 96))
    q, s = quantize(w, 32)
    norm = 1.0 + 0.1 * torch.randn(48, generator=torch.Generator().manual_seed(1))
    reader = _reader(tmp_path, {NAME: q, NAME + SCALE_SUFFIX: s, OTHER: norm})
    want = _reference_dequantize(q, s, 32)
    assert (want - w).abs().max() <= w.abs().max() * 2.0**-4
    for dtype in (torch.float32, torch.bfloat16):
        got = reader.get(NAME, (64, 96), dtype)
        assert got.dtype == dtype
        assert torch.equal(got.float(), want)  # power-of-two scales: exact in bf16 too
    assert torch.equal(reader.get(OTHER, (48,), torch.float32), norm)


def test_ragged_grid_dequantizes_through_the_reader(tmp_path):
    w = _weights((130, 70), seed=2)  # block 32: last row block 2 rows, last column block 6 columns
    q, s = quantize(w, 32)
    assert tuple(s.shape) == (5, 3)
    reader = _reader(tmp_path, {NAME: q, NAME + SCALE_SUFFIX: s})
    torch.testing.assert_close(
        reader.get(NAME, (130, 70), torch.float32), _reference_dequantize(q, s, 32), rtol=0, atol=0
    )


def test_fp8_tensor_read_without_a_block_size_is_named(tmp_path):
    """An fp8 weight with its scale, in a folder whose config.json has no fp8
    quantization_config."""
    q, s = quantize(_weights((64, 64)), 32)
    norm = torch.ones(48)
    reader = _reader(tmp_path, {NAME: q, NAME + SCALE_SUFFIX: s, OTHER: norm}, fp8_block=None)
    with pytest.raises(
        ModelFormatError,
        match=re.escape(f"tensor {NAME!r} is fp8 but config.json has no fp8 quantization_config"),
    ):
        reader.get(NAME, (64, 64), torch.float32)
    assert torch.equal(reader.get(OTHER, (48,), torch.float32), norm)  # plain tensors need no block


def test_fp8_tensor_without_scale_is_named(tmp_path):
    q, _ = quantize(_weights((64, 64)), 32)
    reader = _reader(tmp_path, {NAME: q})
    with pytest.raises(
        ModelFormatError, match=re.escape(f"fp8 tensor {NAME!r} has no {NAME + SCALE_SUFFIX!r}")
    ):
        reader.get(NAME, (64, 64), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_next_to_a_non_fp8_tensor_is_named(tmp_path, dtype):
    w = _weights((64, 64)).to(dtype)
    _, s = quantize(w, 32)
    reader = _reader(tmp_path, {NAME: w, NAME + SCALE_SUFFIX: s})
    with pytest.raises(ModelFormatError, match=re.escape(NAME) + ".*not a 2-D fp8 matrix"):
        reader.get(NAME, (64, 64), torch.float32)


def test_scale_next_to_a_3d_fp8_tensor_is_named(tmp_path):
    name = "model.layers.0.mlp.experts.gate_up_proj"
    q = torch.randn(2, 8, 8).to(FP8)
    reader = _reader(tmp_path, {name: q, name + SCALE_SUFFIX: torch.ones(2, 1, 1)})
    with pytest.raises(ModelFormatError, match=re.escape(name) + ".*not a 2-D fp8 matrix"):
        reader.get(name, (2, 8, 8), torch.float32)


@pytest.mark.parametrize(
    "scale_shape",
    [(33, 2), (65, 2), (2, 65), (2,), (2, 2, 1)],
    ids=["no-block-fits", "more-row-blocks-than-rows", "more-col-blocks-than-cols", "1-d", "3-d"],
)
def test_mismatched_scale_grid_is_named(tmp_path, scale_shape):
    q, _ = quantize(_weights((64, 64)), 32)
    reader = _reader(tmp_path, {NAME: q, NAME + SCALE_SUFFIX: torch.ones(scale_shape)})
    with pytest.raises(ModelFormatError, match=re.escape(f"tensor {NAME!r}")):
        reader.get(NAME, (64, 64), torch.float32)


def _fp8_config(block):
    return {
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": block,
        }
    }


def test_block_size_comes_from_the_fp8_quantization_config():
    assert block_size({"hidden_size": 8}) is None
    assert block_size({"quantization_config": None}) is None
    assert (
        block_size({"quantization_config": {"quant_method": "gptq", "weight_block_size": "x"}})
        is None
    )
    assert block_size(_fp8_config([64, 64])) == (64, 64)
    assert block_size(_fp8_config([64, 128])) == (64, 128)  # rows, then columns


MALFORMED_BLOCKS = [[64], [0, 64], "x", [64, -1], [64, 64, 64], [64.0, 64], None]
MALFORMED_IDS = ["one-number", "zero", "string", "negative", "three-numbers", "float", "missing"]


@pytest.mark.parametrize("block", MALFORMED_BLOCKS, ids=MALFORMED_IDS)
def test_malformed_block_size_is_refused(block):
    with pytest.raises(ValueError):
        block_size(_fp8_config(block))


@pytest.mark.parametrize(
    "block", [[0, 64], [64, -1], [64.0, 64], None], ids=["zero", "negative", "float", "missing"]
)
def test_malformed_block_size_error_names_the_setting(block):
    with pytest.raises(
        ValueError, match=re.escape(f"weight_block_size [rows, cols], got {block!r}")
    ):
        block_size(_fp8_config(block))


def test_block_size_given_as_one_number_is_refused():
    with pytest.raises(ValueError, match="weight_block_size"):
        block_size(_fp8_config(128))


@pytest.mark.parametrize(
    "quant", [{"quant_method": "gptq", "bits": 4}, {"quant_method": "awq"}, {"bits": 8}]
)
def test_unsupported_quantization_is_named(quant):
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "quantization_config": quant,
    }
    with pytest.raises(
        ModelFormatError, match=re.escape(f"unsupported quantization {quant.get('quant_method')!r}")
    ):
        ModelConfig.from_dict(cfg)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert ModelConfig.from_dict({**cfg, "quantization_config": fp8}).hidden_size == 8
    assert ModelConfig.from_dict({**cfg, "quantization_config": None}).hidden_size == 8


# --- whole folders through the loader -------------------------------------------------------


def _fp8_folder(src, dst, block, drop_scale_of=None):
    """A copy of a checkpoint with every projection stored as block-scaled FP8."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.ndim == 2 and name.endswith("_proj.weight"):
            out[name], scale = quantize(t, block)
            if name != drop_scale_of:
                out[name + SCALE_SUFFIX] = scale
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, out


def test_fp8_folder_loads_as_its_dequantized_weights(checkpoint_factory, tmp_path):
    block = 16  # divides every projection dim of the tiny checkpoint (64, 32, 48)
    fp8_dir, tensors = _fp8_folder(checkpoint_factory(), tmp_path / "fp8", block)
    # The same model with the dequantized weights written out in fp32.
    plain_dir = tmp_path / "plain"
    shutil.copytree(fp8_dir, plain_dir)
    plain = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        plain[name] = t if scale is None else _reference_dequantize(t, scale, block)
    assert sum(t.dtype == FP8 for t in tensors.values()) == 3 * (4 + 3 * 8)
    save_file(plain, plain_dir / "model.safetensors")
    cfg = json.loads((plain_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (plain_dir / "config.json").write_text(json.dumps(cfg))

    tokens = torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(11)[None].expand(2, 11)
    logits = []
    for folder in (fp8_dir, plain_dir):
        model = load_model(folder)
        logits.append(model.forward(tokens, positions, model.new_cache(2)))
    assert logits[1].std() > 0.1
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_fp8_folder_with_a_missing_scale_is_named(checkpoint_factory, tmp_path):
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    folder, _ = _fp8_folder(checkpoint_factory(), tmp_path / "fp8", 16, drop_scale_of=name)
    with pytest.raises(ModelFormatError, match=re.escape(f"fp8 tensor {name!r} has no")):
        load_model(folder)


def test_fp8_folder_with_an_unsupported_method_is_named(checkpoint_factory, tmp_path):
    folder, _ = _fp8_folder(checkpoint_factory(), tmp_path / "fp8", 16)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="unsupported quantization 'gptq'"):
        load_model(folder)


def test_scale_grid_not_matching_the_configs_block_size_is_named(checkpoint_factory, tmp_path):
    """A 3x3 grid for a 64x64 weight fits block 22, but the config says 16."""
    name = "model.layers.0.self_attn.o_proj.weight"
    folder, _ = _fp8_folder(checkpoint_factory(), tmp_path / "fp8", 16)
    tensors = load_file(folder / "model.safetensors")
    assert tensors[name + SCALE_SUFFIX].shape == (4, 4)
    tensors[name + SCALE_SUFFIX] = torch.full((3, 3), 2.0**-8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ModelFormatError,
        match=re.escape(name) + r".*blocks of 16x16 needs a scale grid \(4, 4\), got \(3, 3\)",
    ):
        load_model(folder)


def _set_quantization(folder, quant):
    cfg = json.loads((folder / "config.json").read_text())
    if quant is None:
        del cfg["quantization_config"]
    else:
        cfg["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def fp8_folder16(checkpoint_factory, tmp_path):
    return _fp8_folder(checkpoint_factory(), tmp_path / "fp8", 16)[0]


def test_fp8_folder_whose_config_names_another_block_size_is_refused(fp8_folder16):
    _set_quantization(
        fp8_folder16, _fp8_config([32, 32])["quantization_config"]
    )  # the grids are block 16's
    with pytest.raises(
        ModelFormatError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*blocks of 32x32"
    ):
        load_model(fp8_folder16)


@pytest.mark.parametrize("block", MALFORMED_BLOCKS, ids=MALFORMED_IDS)
def test_fp8_folder_with_a_malformed_block_size_is_named(fp8_folder16, block):
    _set_quantization(fp8_folder16, _fp8_config(block)["quantization_config"])
    with pytest.raises(ModelFormatError):
        load_model(fp8_folder16)


def test_fp8_folder_with_a_block_size_given_as_one_number_is_named(fp8_folder16):
    _set_quantization(fp8_folder16, _fp8_config(16)["quantization_config"])
    with pytest.raises(ModelFormatError, match="weight_block_size"):
        load_model(fp8_folder16)


def test_fp8_folder_without_a_quantization_config_is_named(fp8_folder16):
    _set_quantization(fp8_folder16, None)
    with pytest.raises(
        ModelFormatError, match=r"is fp8 but config.json has no fp8 quantization_config"
    ):
        load_model(fp8_folder16)


@pytest.mark.parametrize("quant", ["fp8", ["fp8"], 8])
def test_a_quantization_config_that_is_not_an_object_is_named(quant):
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "quantization_config": quant,
    }
    with pytest.raises(ModelFormatError, match="quantization_config"):
        ModelConfig.from_dict(cfg)


def test_a_block_far_larger_than_the_weight_costs_nothing():
    """The grid is then one block: indexing the scales allocates nothing block-sized."""
    w = _weights((64, 64))
    q, s = quantize(w, 64)
    big = dequantize(q, s, (2**40, 2**40))
    assert torch.equal(big, dequantize(q, s, (64, 64)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_bad_scale_is_refused(tmp_path, bad):
    q, s = quantize(_weights((64, 64)), 32)
    s = s.clone()
    s[0, 1] = bad
    reader = _reader(tmp_path, {NAME: q, NAME + SCALE_SUFFIX: s})
    with pytest.raises(ModelFormatError, match="finite and positive"):
        reader.get(NAME, (64, 64), torch.float32)
