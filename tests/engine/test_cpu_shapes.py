"""engine/bench/cpu_shapes.py: its parameter and byte accounting against the tensors a shape's
folder really holds, and its measurement core on a tiny shape (no timing thresholds)."""

import json
import math

import pytest

from engine.bench import cpu_shapes as cs
from engine.core.options import EngineOptions
from engine.core.request import Request
from engine.loading.loader import load_model
from engine.model.lean_cpu import LeanCpu
from engine.model.lean_matrices import Int8Matrix, int8_available
from engine.models import embedded_model_dir

# MoE layers with ragged FP8 blocks (96 columns), one dense layer, heads of 32.
TINY = cs.Shape(
    hidden=64,
    layers=3,
    q_heads=4,
    kv_heads=2,
    experts=4,
    top_k=2,
    moe_inter=96,
    head_dim=32,
    dense_layers=(1,),
    dense_inter=128,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = TINY.config()
    folder = cs.write_folder(config, tmp_path_factory.mktemp("tiny"), seed=1)
    return config, folder, load_model(folder)


def test_parameters_match_the_loaded_models_tensors(tiny):
    config, _, model = tiny
    params = cs.accounting(config)["params"]
    k, e = config["num_experts_per_tok"], config["num_experts"]
    total, active = model.final_norm.numel(), model.final_norm.numel()
    for layer in model.layers:
        for name, w in vars(layer).items():
            if w is None:
                continue
            total += w.numel()
            expert = layer.router is not None and name in ("w_gate_up", "w_down")
            active += w.numel() * k // e if expert else w.numel()
    assert params == dict(embedding=model.embed.numel(), total=total, active=active)
    assert model.lm_head is model.embed  # tied: counted once, as the embedding


def test_disk_bytes_match_the_written_files(tiny, tmp_path):
    config, folder, _ = tiny
    disk = cs.accounting(config)["disk_bytes"]
    assert cs.file_tensor_bytes(folder / "model.safetensors") == disk["fp8-64"]
    int4_folder = cs.write_folder(config, tmp_path / "int4", seed=1, fmt="int4")
    assert cs.file_tensor_bytes(int4_folder / "model.safetensors") == disk["int4-g32"]
    load_model(int4_folder)  # a folder the engine reads
    bf16 = int8 = 0
    for spec, t in cs.random_weights(config):
        bf16 += t.numel() * 2
        int8 += Int8Matrix(t).nbytes if spec.kind == "projection" else t.numel() * 2
    assert (disk["bf16"], disk["int8-rows"]) == (bf16, int8)


def test_the_shipped_shape_is_the_embedded_models():
    config = json.loads((embedded_model_dir() / "config.json").read_text())
    assert cs.SHAPES["shipped"].config() == cs.Shape.of_config(config).config()
    counted = cs.accounting(config)
    stored = (
        "int4-g32"
        if config["quantization_config"]["quant_method"] == "compressed-tensors"
        else "fp8-64"
    )
    assert (
        cs.file_tensor_bytes(embedded_model_dir() / "model.safetensors")
        == (counted["disk_bytes"][stored])
    )
    assert (
        counted["params"]["total"]
        == cs.accounting(cs.SHAPES["shipped"].config())["params"]["total"]
    )


@pytest.mark.parametrize("form", ["fp32", "int8"])
def test_step_bytes_match_the_lean_copies(tiny, form):
    if form == "int8" and not int8_available():
        pytest.skip("this torch lacks _weight_int8pack_mm")
    config, _, model = tiny
    lean = LeanCpu(model, form)
    lean.prepare()
    k = config["num_experts_per_tok"]
    streamed = lean._lm_head.nbytes
    for layer, copies in zip(model.layers, lean.layers):
        streamed += copies.w_qkv.nbytes + copies.w_o.nbytes
        if layer.router is None:  # the general path's fp32 weights
            streamed += (layer.w_gate_up.numel() + layer.w_down.numel()) * 4
        else:
            streamed += copies.router.numel() * 4
            streamed += k * (copies.gate_up[0].nbytes + copies.down[0].nbytes)
    assert cs.accounting(config)["step_bytes"][form] == streamed


@pytest.fixture(scope="module")
def bench():
    return cs.Bench(runs=2, warmups=0, cached_repeat=1, load_repeat=1, cached_tokens=120)


def test_completions_write_the_script(tiny, bench):
    _, _, model = tiny
    engine = cs.scripted_engine(model, bench.tokenizer, bench.script, EngineOptions())
    done = engine.complete(Request(bench.prompt, max_tokens=30, stop_at_eos=False)).check()
    n = len(bench.script)
    assert n == cs.NEW_TOKENS
    assert done.token_ids == (bench.script + bench.script)[:30]


def test_measure_on_a_tiny_shape(tiny, bench, tmp_path):
    config = tiny[0]
    lines = []
    bench.log = lines.append
    (row,) = cs.measure(bench, {"tiny": config}, ("base", config), tmp_path)
    assert row["name"] == "tiny" and row["params"] == cs.accounting(config)["params"]
    assert row["file_tensor_bytes"] == row["disk_bytes"]["int4-g32"] < row["file_bytes"]
    for side in ("candidate", "baseline"):
        numbers = row[side]
        assert numbers["load_ms"] > 0 and set(numbers["lean_copies_ms"]) == set(cs.FORMS)
        for form in cs.FORMS:
            got = numbers[form]
            assert len(got["cold_ms"]) == 2
            for key in ("cold_p50_ms", "prefill_ms", "step_ms", "cached_first_token_ms"):
                assert got[key] > 0
    for form in cs.FORMS:
        assert math.isfinite(row["ratio_to_baseline"][form]["cold_p50_ms"])
    assert lines == [cs.format_row(row)]
    json.dumps(row)  # what --json writes


def test_list_names_every_shape(capsys):
    assert cs.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cs.SHAPES)
    with pytest.raises(SystemExit):
        cs.main(["--shapes", "no-such-shape"])
