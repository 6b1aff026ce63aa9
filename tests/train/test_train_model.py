"""The training model: its dense and sparse MoE forms are one function, it matches transformers'
Qwen3-MoE, and the training step traces as one graph (what `torch.compile` needs on the GPU)."""

import pytest
import torch
import torch.nn.functional as F
from tiny_training import TINY

from engine.train.model import Qwen3MoeLM


def _pair(seed=0):
    sparse, dense = Qwen3MoeLM(TINY), Qwen3MoeLM(TINY, dense_moe=True)
    sparse.init_weights(seed)
    with torch.no_grad():  # larger than init so routing and experts matter in the comparison
        for p in sparse.parameters():
            p.mul_(4.0)
    dense.load_state_dict(sparse.state_dict())
    return sparse, dense


@torch.enable_grad()  # another test's CLI may have switched grad mode off for the process
def test_dense_and_sparse_moe_give_the_same_logits_and_gradients():
    torch.manual_seed(0)
    sparse, dense = _pair()
    ids = torch.randint(0, TINY["vocab_size"], (3, 17))
    grads = []
    for model in (sparse, dense):
        logits, aux = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * aux
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    (ls, aux_s), (ld, aux_d) = sparse(ids), dense(ids)
    torch.testing.assert_close(ld, ls, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux_d, aux_s)
    assert ls.std() > 0.1  # not a degenerate comparison
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-3, atol=1e-4, msg=name)
    expert_grads = [g for n, g in grads[0].items() if ".experts." in n]
    assert sum(int(g.abs().sum() > 0) for g in expert_grads) > len(expert_grads) // 2


def test_training_model_matches_transformers(tmp_path):
    """Through the on-disk layout the checkpoints use (per-expert keys, tied lm_head omitted)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from engine.train.config import write_configs

    torch.manual_seed(1)
    model, _ = _pair(1)
    write_configs(tmp_path, {**TINY, "torch_dtype": "float32"})
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 13))
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_training_step_is_one_graph():
    """No graph break in the dense form (the sparse one syncs on expert counts by design)."""
    from engine.train.train import lm_loss

    torch._dynamo.reset()
    _, dense = _pair()
    rows = torch.randint(0, TINY["vocab_size"], (2, 9))
    explanation = torch._dynamo.explain(lm_loss)(dense, rows)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_checkpoints_round_trip_and_a_run_resumes_from_an_exported_folder(tmp_path):
    import json

    from safetensors.torch import save_file

    from engine.train import checkpoint

    model, _ = _pair(2)
    checkpoint.save(model, {"step": 7}, tmp_path / "run" / "ckpt")
    checkpoint.save(model, {"step": 8}, tmp_path / "run" / "ckpt")  # replaces the first whole
    assert not (tmp_path / "run" / "ckpt.tmp").exists()
    back = checkpoint.load_weights(tmp_path / "run" / "ckpt")
    assert back.keys() == model.state_dict().keys()
    assert checkpoint.load_state(tmp_path / "run" / "ckpt")["step"] == 8

    exported = tmp_path / "model"
    exported.mkdir()
    save_file({k: v.contiguous() for k, v in back.items()}, str(exported / "model.safetensors"))
    (exported / "training_state.json").write_text(json.dumps({"step": 8}))
    (exported / "training_log.jsonl").write_text('{"step": 8}\n')
    torch.testing.assert_close(checkpoint.load_weights(exported), back)
    assert checkpoint.load_state(exported)["step"] == 8
    assert checkpoint.previous_log(exported) == exported / "training_log.jsonl"


def test_learning_rate_warms_up_holds_and_decays_to_the_final_fraction():
    from engine.train.train import lr_at, parse_args

    base = [
        "--model-dir",
        "m",
        "--out",
        "o",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "10",
        "--decay-frac",
        "0.5",
    ]
    args = parse_args(base)  # the default ends the decay at 10% of the peak
    assert lr_at(0, 0.0, args) == pytest.approx(1e-4)  # the first of 10 warm-up steps
    assert lr_at(50, 0.3, args) == pytest.approx(1e-3)  # held before the last half of the budget
    assert lr_at(50, 0.75, args) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # halfway down
    assert lr_at(50, 1.0, args) == pytest.approx(1e-4)
    annealed = parse_args(base + ["--final-lr-frac", "0"])
    assert lr_at(50, 0.75, annealed) == pytest.approx(5e-4)
    assert lr_at(50, 1.0, annealed) == 0.0
    with pytest.raises(SystemExit):
        parse_args(base + ["--final-lr-frac", "1.5"])
