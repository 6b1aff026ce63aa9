"""The training model: its sparse, dense and grouped MoE forms are one function, it matches
transformers' Qwen3-MoE, and the training step traces as one graph (what `torch.compile` needs on
the GPU)."""

import pytest
import torch
import torch.nn.functional as F
from tiny_training import TINY

from engine.train.model import MOE_FORMS, Qwen3MoeLM


def _models(seed=0):
    """The same weights in every MoE form, 4x init so routing and experts matter."""
    models = {form: Qwen3MoeLM(TINY, moe=form) for form in MOE_FORMS}
    models["sparse"].init_weights(seed)
    with torch.no_grad():
        for p in models["sparse"].parameters():
            p.mul_(4.0)
    for model in models.values():
        model.load_state_dict(models["sparse"].state_dict())
    return models


def _loss_and_grads(model, ids):
    logits, aux = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * aux
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach(), aux.detach(), grads


@pytest.mark.parametrize("form", ["dense", "grouped"])
@torch.enable_grad()  # another test's CLI may have switched grad mode off for the process
def test_every_moe_form_gives_the_sparse_logits_and_gradients(form):
    torch.manual_seed(0)
    models = _models()
    # 3 x 17 tokens at top-2 of 8 experts: groups of uneven size, none a multiple of 16 rows.
    ids = torch.randint(0, TINY["vocab_size"], (3, 17))
    ls, aux_s, want = _loss_and_grads(models["sparse"], ids)
    lf, aux_f, got = _loss_and_grads(models[form], ids)
    # fp32 sums in another order (and split across threads differently): the error scales with
    # the logits, about 1e-6 of the largest through 4x-initialised layers.
    torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5 * float(ls.abs().max()))
    torch.testing.assert_close(aux_f, aux_s)
    assert ls.std() > 0.1  # not a degenerate comparison
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-3, atol=1e-4, msg=name)
    expert_grads = [g for n, g in want.items() if ".experts." in n]
    assert sum(int(g.abs().sum() > 0) for g in expert_grads) > len(expert_grads) // 2


@pytest.mark.parametrize("empty", [(0,), (3,), (7,), (0, 3, 7)], ids=str)
@torch.enable_grad()
def test_the_grouped_form_with_experts_no_token_chose(empty):
    """An empty group (first, middle, last) is a zero-row GEMM between its neighbours'."""
    g = torch.Generator().manual_seed(4)
    chosen = [e for e in range(TINY["num_experts"]) if e not in empty]
    pairs = [torch.randperm(len(chosen), generator=g)[:2] for _ in range(20)]
    ids = torch.tensor(chosen)[torch.stack(pairs)]  # [20, 2], two distinct experts a token
    weights = torch.rand(20, 2, generator=g).softmax(-1)
    x = 10 * torch.randn(20, TINY["hidden_size"], generator=g)
    out = {}
    models = _models(5)
    for form in ("sparse", "grouped"):
        layer = models[form].model.layers[0].mlp
        layer.route = lambda h, w=weights, i=ids: (w, i, h.sum() * 0)
        xf = x.clone().requires_grad_()
        y, _ = layer(xf)
        y.backward(torch.ones_like(y))
        # An expert no token chose has no gradient in the sparse form, zeros in the grouped one.
        grads = [
            torch.zeros_like(p) if p.grad is None else p.grad for p in layer.experts.parameters()
        ]
        out[form] = [y.detach(), xf.grad, *grads]
    assert out["sparse"][0].std() > 0.1
    for got, want in zip(out["grouped"], out["sparse"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_model_matches_transformers(tmp_path):
    """Through the on-disk layout the checkpoints use (per-expert keys, tied lm_head omitted)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from engine.train.config import write_configs

    torch.manual_seed(1)
    model = _models(1)["sparse"]
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


@pytest.mark.parametrize("form", ["dense", "grouped"])
def test_training_step_is_one_graph(form):
    """No graph break in the static-shape forms (the sparse one syncs on expert counts)."""
    from engine.train.train import lm_loss

    torch._dynamo.reset()
    model = _models()[form]
    rows = torch.randint(0, TINY["vocab_size"], (2, 9))
    # bf16 autocast as the GPU trains (the grouped GEMM's traced form takes bf16 only).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(lm_loss)(model, rows)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_checkpoints_round_trip_and_a_run_resumes_from_an_exported_folder(tmp_path):
    import json

    from safetensors.torch import save_file

    from engine.train import checkpoint

    model = _models(2)["sparse"]
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


def test_the_default_moe_form_follows_the_device(monkeypatch):
    from engine.train.train import default_moe_form, parse_args

    assert default_moe_form("cpu") == "sparse"
    for capability, form in (((9, 0), "grouped"), ((10, 0), "grouped"), ((8, 9), "dense")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert default_moe_form("cuda:0") == form
    args = parse_args(["--model-dir", "m", "--out", "o", "--device", "cuda", "--moe", "dense"])
    assert args.moe == "dense"  # asked for, not replaced
