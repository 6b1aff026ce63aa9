"""The embedded default model: it loads with transformers and with the engine and both agree, its
tokenizer round-trips source byte-exactly, it completes an obvious line, and the eval runs."""

import ast
import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest
import torch

MODEL_DIR = Path(__file__).resolve().parents[1] / "engine" / "models" / "wd-coder-small"
HAS_ENGINE = all(
    importlib.util.find_spec(m)
    for m in ("engine.loading.loader", "engine.core.engine", "engine.prompts.fim")
)
needs_engine = pytest.mark.skipif(not HAS_ENGINE, reason="engine modules not present")

PROMPTS = [
    "import os\n\n\ndef main(argv):\n    path = os.path.join(",
    "<|fim_suffix|>\n    return total\n<|fim_prefix|>def total(xs):\n    <|fim_middle|>",
]


def test_shipped_files_are_complete_and_small():
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "loss.png",
    ):
        assert (MODEL_DIR / name).is_file(), name
    # The cap on the shipped weights: 128 MB, any shard under 100 MB.
    shards = list(MODEL_DIR.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in shards) <= 128 * 2**20
    assert all(f.stat().st_size < 100 * 2**20 for f in shards)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["vocab_size"] <= 16384


def test_safetensors_uses_the_per_expert_hf_layout():
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    config = json.loads((MODEL_DIR / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        assert f"model.layers.{layer}.mlp.gate.weight" in keys
        for e in range(config["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                # bf16 or FP8 (`weight`), or int4 groups (compressed-tensors' `weight_packed`)
                assert {f"{name}.weight", f"{name}.weight_packed"} & keys, name


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    # An int4 checkpoint's fused experts, dequantized at load, keep the scales' dtype (bf16), so
    # would compute in bf16 whatever dtype was asked; their values are exact in bf16, so fp32
    # copies are the shipped weights (transformers refuses .float() on a quantized model).
    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    return model


@pytest.fixture(scope="module")
def backend():
    """The engine when present, else transformers, behind one small interface."""
    from engine.train.eval import EngineBackend, TransformersBackend

    return EngineBackend(MODEL_DIR) if HAS_ENGINE else TransformersBackend(MODEL_DIR)


@needs_engine
def test_engine_logits_match_transformers(hf_model):
    from engine.loading.loader import load_model
    from engine.loading.tokenizer import Tokenizer
    from engine.model.options import ModelOptions

    # The general path, prefill's arithmetic (short prompts would take the lean forward, whose
    # int4 step computes in bf16: the tests below pin its answers).
    model = load_model(MODEL_DIR, options=ModelOptions(lean_decode=False))
    tok = Tokenizer.from_dir(MODEL_DIR)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = model.forward(
            torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(1, capacity=len(ids))
        )[0]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


@needs_engine
@pytest.mark.parametrize("options", [dict(lean_weights="fp32"), dict(lean_guard=True)])
def test_exact_decode_steps_keep_transformers_greedy_tokens(hf_model, options):
    """The CPU's lean forward (these short prompts and every decode step) over fp32 copies of the
    weights, and the int4 one with its guard (recomputed from fp32 where not decisive), give fp32
    transformers' greedy tokens for 32 free-running steps on these plain prompts. (The unguarded
    int4 step, the default, keeps the pinned single-line answers below; over 32 free steps one
    near-tie may go the other way.)"""
    from engine_runs import complete

    from engine.loading.loader import load_model
    from engine.loading.tokenizer import Tokenizer
    from engine.model.options import ModelOptions

    model = load_model(MODEL_DIR, options=ModelOptions(**options))
    assert model.lean_path_applies()
    tok = Tokenizer.from_dir(MODEL_DIR)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        _, stats = complete(model, tok, ids, max_tokens=32, stop_at_eos=False)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert stats.token_ids == out[0, len(ids) :].tolist()


# FIM tasks as `wd-engine generate --fim-prefix ... --fim-suffix ... --stop '\n'` runs them, among
# them ones where int8 decode weights once changed the shipped model's answer (`def add(a, b):`
# completed `= a.is_nonnegative` instead of `a + b`).
PINNED_FIM = [
    ("def add(a, b):\n    return ", "\n"),
    ("def fib(n):\n    if n < 2:\n        return n\n    return ", "\n"),
    ("def square(x):\n    return x ", "\n"),
    ("def mean(xs):\n    return sum(xs) / ", "\n"),
    ("import os\n\ndef read_file(path):\n    with open(path) as f:\n        return ", "\n"),
    ("function add(a, b) {\n  return ", "\n}\n"),
]


@needs_engine
def test_default_decode_gives_the_models_own_greedy_answers():
    """The CPU's default arithmetic (the lean forward for these short prompts and every decode
    step, with speculation, as `generate` and the daemon run it) completes each pinned task as
    the general path, prefill's arithmetic for long prompts, does."""
    from engine.core.engine import Engine
    from engine.core.request import Request
    from engine.loading.loader import load_model
    from engine.loading.tokenizer import Tokenizer
    from engine.model.options import ModelOptions
    from engine.prompts.fim import build_fim_prompt, healed_text

    tok = Tokenizer.from_dir(MODEL_DIR)
    default = load_model(MODEL_DIR)
    general = load_model(MODEL_DIR, options=ModelOptions(lean_decode=False))
    assert default.lean_path_applies() and not general.lean_path_applies()
    answers = []
    for prefix, suffix in PINNED_FIM:
        prompt = build_fim_prompt(tok, prefix, suffix, "spm", heal=True)
        texts = []
        for model in (default, general):
            req = Request(
                list(prompt), max_tokens=24, stop=("\n",), forced_text=healed_text(tok, prefix)
            )
            texts.append(Engine.for_one_request(model, tok, req).complete(req).check().text)
        assert texts[0] == texts[1], (prefix, texts)
        answers.append(texts[0])
    assert sum(map(bool, answers)) >= len(PINNED_FIM) // 2, answers  # not a vacuous comparison


def test_transformers_loads_and_predicts_code(hf_model):
    from engine.train.data import load_tokenizer

    tok = load_tokenizer(MODEL_DIR / "tokenizer.json")
    ids = tok.encode(
        "import os\nimport sys\n\n\ndef main():\n    print(sys.argv)\n\n\n"
        "if __name__ == '__main__':\n   "
    ).ids
    with torch.no_grad():
        nxt = hf_model(torch.tensor([ids])).logits[0, -1].argmax().item()
    assert tok.decode([nxt]) == " main"


def _source_samples():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (stdlib / name).read_text(encoding="utf-8")
        for name in ("os.py", "textwrap.py", "json/decoder.py")
    ]
    return texts + [
        "naïve café 你好 🙂\tx = 1\r\n",
        "  \n\n\t\t  trailing   \n",
        "s = '<|endoftext|><|fim_prefix|>'\n",
        "\x00\x7f\u2028 ∑ 𝔘",
        "",
    ]


def test_tokenizer_round_trips_source_byte_exactly():
    from engine.train.data import load_tokenizer

    tok = load_tokenizer(MODEL_DIR / "tokenizer.json")
    for text in _source_samples():
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    if HAS_ENGINE:
        from engine.loading.tokenizer import Tokenizer

        etok = Tokenizer.from_dir(MODEL_DIR)
        for text in _source_samples():
            assert etok.decode(etok.encode(text)) == text


def test_fim_completes_an_obvious_line(backend):
    prefix = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        "
    suffix = "\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
    middle = backend.fim(prefix, suffix, "spm", "single")
    assert middle.strip()
    ast.parse(prefix + middle + suffix)


def test_eval_command_runs_on_a_few_heldout_files(tmp_path):
    from engine.train import eval as evaluation

    out = tmp_path / "eval.json"
    evaluation.main(
        [
            "--model",
            str(MODEL_DIR),
            "--files",
            "2",
            "--orders",
            "spm",
            "--bpb-tokens",
            "128",
            "--tasks-per-file",
            "2",
            "--allow-changed",
            "--json",
            str(out),
            "--details",
            str(tmp_path / "d.jsonl"),
        ]
        + ([] if HAS_ENGINE else ["--backend", "transformers"])
    )
    result = json.loads(out.read_text())
    assert result["files"] == 2 and result["tasks_per_file"] == 2
    for key in ("single_spm", "multi_spm"):
        r = result[key]
        assert r["tasks"] == 4
        assert 0.0 <= r["exact_match"] <= 1.0 and 0.0 <= r["edit_similarity"] <= 1.0
        low, high = r["exact_match_ci95"]
        assert low <= r["exact_match"] <= high and high - low > 0.3  # four tasks say little
    details = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(details) == 8 and len({(d["kind"], d["task"]) for d in details}) == 8
    single = [d for d in details if d["kind"] == "single"]
    assert sum(d["exact"] for d in single) / 4 == result["single_spm"]["exact_match"]
    assert 0.0 < result["bits_per_byte"] < 8.0


@needs_engine
@pytest.mark.parametrize("layout", ["eval", "server"])
def test_eval_prompts_fit_the_models_context(tmp_path, layout):
    from engine.train import eval as evaluation

    out = tmp_path / "eval.json"
    evaluation.main(
        [
            "--model",
            str(MODEL_DIR),
            "--files",
            "2",
            "--kinds",
            "single",
            "--orders",
            "spm",
            "--bpb-tokens",
            "0",
            "--allow-changed",
            "--prefix-chars",
            "20000",
            "--suffix-chars",
            "3000",
            "--layout",
            layout,
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())  # prompts past the context would have been refused
    assert result["layout"] == layout and result["context_chars"] == [20000, 3000]
    assert result["single_spm"]["tasks"] == 2


@needs_engine
def test_eval_editor_context_is_the_servers_fitted_budget(tmp_path):
    from wd_lsp.bench import editor_eval
    from wd_lsp.config import Settings

    out = tmp_path / "eval.json"
    editor_eval.main(
        [
            "--model",
            str(MODEL_DIR),
            "--files",
            "2",
            "--kinds",
            "single",
            "--orders",
            "spm",
            "--bpb-tokens",
            "0",
            "--allow-changed",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    prefix_chars, suffix_chars = result["context_chars"]
    assert result["layout"] == "server" and 0 < suffix_chars < prefix_chars < 3.5 * 1024
    assert result["server_max_tokens"] == Settings().max_tokens


@needs_engine
def test_eval_by_beam_search_answers_every_single_line(tmp_path):
    from engine.train import eval as evaluation

    out, details = tmp_path / "eval.json", tmp_path / "d.jsonl"
    evaluation.main(
        [
            "--model",
            str(MODEL_DIR),
            "--files",
            "3",
            "--kinds",
            "single",
            "--orders",
            "spm",
            "--bpb-tokens",
            "0",
            "--tasks-per-file",
            "2",
            "--allow-changed",
            "--beams",
            "4",
            "--json",
            str(out),
            "--details",
            str(details),
        ]
    )
    result = json.loads(out.read_text())
    assert result["single_line_beams"] == 4 and result["single_spm"]["tasks"] == 6
    preds = [json.loads(line)["pred"] for line in details.read_text().splitlines()]
    assert len(preds) == 6 and all(p.strip() and "\n" not in p for p in preds)  # never a blank line


def test_config_declares_the_context_the_model_was_trained_on():
    """Positions past the longest training row were never seen (run 7 lost half its exact matches
    when prompted past 1,024 tokens), so the engine must not prompt past it."""
    from engine.train.export import trained_context

    config = json.loads((MODEL_DIR / "config.json").read_text())
    state = json.loads((MODEL_DIR / "training_state.json").read_text())
    assert config["max_position_embeddings"] == trained_context(state)


@needs_engine
def test_the_language_servers_fitted_context_fits_the_engines_prompt_uncut():
    """The server's context, fitted to the model, reaches the daemon's prompt whole: the engine
    never has to cut the prefix's start itself (it would move with every keystroke)."""
    import argparse  # a long file of typical density (about 3.7 characters a token)

    from engine.decoding.token_healing import token_healer
    from engine.loading.tokenizer import Tokenizer
    from engine.prompts.layout import build_completion_prompt, prompt_budget
    from wd_lsp.context import Budget, build_context
    from wd_lsp.document import Document

    tok = Tokenizer.from_dir(MODEL_DIR)
    context = json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    text = Path(argparse.__file__).read_text()
    doc = Document("file:///argparse.py", text, "python")
    budget = Budget().fitted(context, 64)
    for offset in (len(text) // 3, len(text) // 2, 2 * len(text) // 3):
        ctx = build_context(doc, doc.position_at(offset), budget=budget)
        assert ctx.prefix_truncated and ctx.suffix_truncated
        ids = build_completion_prompt(
            tok,
            ctx.prefix,
            ctx.suffix,
            order="spm",
            repo_context=False,
            heal=True,
            max_prompt_tokens=prompt_budget(context, 64, 4096),
        )
        healed_prefix = token_healer(tok).split(ctx.prefix)[0]
        assert ids[-len(healed_prefix) - 2 : -1] == [tok.token_id("<|fim_prefix|>"), *healed_prefix]
        assert len(ids) <= context - 65
