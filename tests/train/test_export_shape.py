"""A model trained from scratch at a shape other than the shipped one: its checkpoint records the
shape, and `export` writes that shape (not engine/train/config.py's), so the engine and the next
resume read the model that was trained."""

import json

import pytest
import torch
from checkpoints import engine_logits, max_rel, quantizable_training_config, scaled_training_model

from engine.train import checkpoint, export

# Another shape than the config the tests usually train: wider, deeper, more heads and experts.
OTHER = {
    **quantizable_training_config(),
    "hidden_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "num_experts": 6,
    "moe_intermediate_size": 64,
}


@pytest.mark.parametrize("int4_group", [None, 32])
def test_export_writes_the_shape_the_checkpoint_records(tmp_path, int4_group):
    model = scaled_training_model(OTHER, seed=3)
    with torch.no_grad():  # what a checkpoint keeps (bf16), so the export's logits can be exact
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    if int4_group:
        model.set_int4_training(int4_group)
    model.eval()
    state = {"step": 5, "tokens_seen": 640, "train_seconds": 1.0, "runs": [{"seq_len": 256}]}
    checkpoint.save(model, state, tmp_path / "ckpt", OTHER)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == OTHER

    args = ["--ckpt", str(tmp_path / "ckpt"), "--model-dir", str(tmp_path / "model")]
    export.main(args + (["--int4-group", str(int4_group)] if int4_group else []))
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert written[key] == OTHER[key], key
    assert written["num_experts"] == 6 and written["moe_intermediate_size"] == 64
    assert written["max_position_embeddings"] == 256  # the rows it trained on
    assert ("quantization_config" in written) == bool(int4_group)

    ids = torch.randint(0, OTHER["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        trained, _ = model(ids)
    assert max_rel(engine_logits(tmp_path / "model", ids), trained) < 1e-4
    # An exported folder resumes at its own shape too.
    assert export.trained_shape(tmp_path / "model")["hidden_size"] == 96


def test_a_checkpoint_without_a_recorded_shape_exports_the_default_config(tmp_path):
    model = scaled_training_model(quantizable_training_config(), seed=1)
    checkpoint.save(
        model, {"step": 1, "tokens_seen": 1, "train_seconds": 0.1, "runs": []}, tmp_path
    )
    assert not (tmp_path / "config.json").exists()
    assert export.trained_shape(tmp_path) == export.CONFIG
