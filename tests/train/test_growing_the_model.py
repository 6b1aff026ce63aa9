"""Growing a trained model (engine/train/grow.py): wider experts and more experts compute the
trained model's function, and training resumes from an FP8 export with either, never shrinking."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_training import EXPORT_BLOCK, EXPORT_TINY, TINY, export_fp8, tiny_model

from engine.train.grow import expert_width, widen_experts
from engine.train.model import MOE_FORMS, Qwen3MoeLM

# --- widening the experts ------------------------------------------------------------------


@pytest.mark.parametrize("moe", MOE_FORMS)
@torch.enable_grad()
def test_widened_experts_compute_the_same_function(moe):
    model = tiny_model(moe=moe)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert expert_width(weights) == 32
    grown = widen_experts(weights, 48, std=0.5, seed=1)
    assert expert_width(grown) == 48
    wide = Qwen3MoeLM({**TINY, "moe_intermediate_size": 48}, moe=moe)
    wide.load_state_dict(grown)  # strict: every name, every shape

    ids = torch.randint(0, TINY["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before, aux_before = model(ids)
    after, aux_after = wide(ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux_after, aux_before)
    assert before.std() > 0.1

    # The new units are live (their gate/up rows are random), so training can move their down
    # columns.
    F.cross_entropy(after.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    new_down_grads = [
        m.down_proj.weight.grad[:, 32:] for layer in wide.model.layers for m in layer.mlp.experts
    ]
    assert sum(int(g.abs().sum() > 0) for g in new_down_grads) > len(new_down_grads) // 2


def test_widen_experts_layout():
    weights = {k: v.to(torch.bfloat16) for k, v in tiny_model().state_dict().items()}
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
    weights = tiny_model().state_dict()
    with pytest.raises(ValueError, match="from 32 to 16"):
        widen_experts(weights, 16)
    assert expert_width({"model.embed_tokens.weight": torch.zeros(4, 4)}) == 0


def test_export_writes_the_expert_width_the_checkpoint_has(tmp_path, monkeypatch):
    """A widened run's checkpoint exports with its own moe_intermediate_size, not CONFIG's."""
    from engine.loading.loader import load_model
    from engine.train import checkpoint, export

    wide = {**EXPORT_TINY, "moe_intermediate_size": EXPORT_TINY["moe_intermediate_size"] * 2}
    model = tiny_model(wide, seed=11)
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


# --- adding experts ------------------------------------------------------------------------


def test_router_loads_count_every_top_k_slot():
    from engine.train.grow import router_loads

    model = tiny_model()
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

    weights = {k: v.to(torch.bfloat16) for k, v in tiny_model().state_dict().items()}
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
    model = tiny_model(config, seed=4)
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


# --- resuming training from an FP8 export, grown -------------------------------------------


def _resume_one_step(tmp_path, monkeypatch, *grow_args):
    """`train --resume FP8_EXPORT GROW_ARGS --fp8-block 32`, one step at lr 0 on the CPU (so the
    step changes nothing); returns the exported model, its folder (also the run's --model-dir),
    its config and the run's output folder."""
    from checkpoints import TRAINING_TEXT, build_tokenizer

    from engine.train import plot, train

    tok = build_tokenizer()
    config = {**EXPORT_TINY, "vocab_size": tok.get_vocab_size()}
    model, model_dir = export_fp8(tmp_path, EXPORT_BLOCK, config)
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


def test_training_resumes_from_an_fp8_export_with_more_experts(tmp_path, monkeypatch):
    """`train --resume FP8_EXPORT --add-experts 6`, one step at lr 0 on the CPU: the checkpoint
    holds the export's weights and two copies of experts per layer; its export says 6 experts,
    and the engine loads it."""
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
    _, model_dir = export_fp8(
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
