"""Broken model folders give errors that name what is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.loader import load_model
from engine.model.config import ModelFormatError


@pytest.fixture
def broken(checkpoint_factory, tmp_path):
    src = checkpoint_factory()
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_is_named(broken):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(broken, lambda t: t.pop(name))
    with pytest.raises(ModelFormatError, match="missing tensor.*experts.3.up_proj"):
        load_model(broken)


def test_misshaped_tensor_is_named(broken):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(broken, lambda t: t.__setitem__(name, torch.randn(5, 64)))
    with pytest.raises(ModelFormatError, match=r"k_proj.weight.*shape \(5, 64\)"):
        load_model(broken)


def test_unsupported_architecture_is_named(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="unsupported architecture 'MixtralForCausalLM'"):
        load_model(broken)


def test_missing_folder_and_weights(tmp_path):
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
            }
        )
    )
    with pytest.raises(ModelFormatError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_missing_shard_is_named(checkpoint_factory, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(checkpoint_factory(max_shard_size="100KB"), dst)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFormatError, match=shard.name):
        load_model(dst)
