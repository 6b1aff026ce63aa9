"""engine.bench.decode's check of the fused steps, on the CPU (Triton's interpreter)."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from engine.bench.decode import fused_against_unfused, parse_variants
from engine.loading.random_model import SHAPES
from engine.model.step_kernels import FUSIONS


def test_every_fused_step_gives_the_unfused_steps_logits():
    lines = []
    rows = fused_against_unfused(
        SHAPES["tiny"], None, torch.float32, "cpu", batch=2, context=20, log=lines.append
    )
    assert [r["variant"] for r in rows] == [*FUSIONS, "engine's step", "all fusions"]
    assert all(r["rel"] < 1e-5 and r["replays_identical"] for r in rows), rows
    assert len(lines) == len(rows)


def test_the_timed_variants_are_checked_too():
    rows = fused_against_unfused(
        SHAPES["tiny"],
        None,
        torch.float32,
        "cpu",
        batch=1,
        context=20,
        log=lambda _: None,
        variants=parse_variants(
            "router|router+pdl|router+pdl+attention_merge|router:splits=3,route_e=2,unlink=moe"
        ),
    )
    assert [r["variant"] for r in rows][-3:] == [
        "router+pdl",
        "router+pdl+attention_merge",
        "router:splits=3,route_e=2,unlink=moe",
    ]
    assert all(r["rel"] < 1e-5 and r["replays_identical"] for r in rows), rows


def test_chosen_step_variants_are_timed_as_named():
    from engine.bench.decode import parse_variants, step_variants

    steps = parse_variants("unfused|router|router+pdl|router+pdl:splits=16,route_e=4,unlink=moe")
    assert [s.fusions for s in steps] == [(), ("router",), ("router", "pdl"), ("router", "pdl")]
    cfg = SimpleNamespace(num_kv_heads=4)
    variants = dict(step_variants(cfg, batch=1, context=64, variants=steps))
    assert [name.split(" ")[0] for name in variants] == [
        "unfused",
        "router",
        "router+pdl",
        "router+pdl:splits=16,route_e=4,unlink=moe",
    ]
    kernels = list(variants.values())
    pdl = {"router", "pdl"}
    assert [k.fusions for k in kernels] == [set(), {"router"}, pdl, pdl]
    assert (kernels[3].n_splits, kernels[3].router_block_e, kernels[3].unlinked) == (
        16,
        4,
        {"moe"},
    )
    assert list(variants)[3].endswith("(16 splits)") and kernels[0].n_splits is None


def test_a_variant_naming_an_unknown_fusion_is_refused():
    from engine.bench.decode import parse_variants

    for spec in (
        "router+fast",
        "router||pdl",
        "router:fast=1",
        "pdl:unlink=attention",
        "pdl:splits=",
    ):
        with pytest.raises(argparse.ArgumentTypeError, match="bad variant"):
            parse_variants(spec)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_a_quantized_lm_head_is_counted_and_timed_against_bf16(quant):
    """The floor counts the lm_head in its format; the variants' bf16 twin holds its values."""
    from engine.bench.decode import WEIGHT_BYTES, step_bytes, with_plain_lm_head
    from engine.loading.random_model import random_model
    from kernels.quant import dequantize, is_quantized

    config = dict(SHAPES["tiny"], vocab_size=512, tie_word_embeddings=False)
    model = random_model(config, torch.float32, quant=quant, quant_size=16, quant_lm_head=True)
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    assert step_bytes(cfg, 1, 64, quant, True)["lm_head"] == head * WEIGHT_BYTES[quant]
    assert step_bytes(cfg, 1, 64, quant)["lm_head"] == head * 2
    twin = with_plain_lm_head(model)
    assert not is_quantized(twin.lm_head) and twin.layers is model.layers
    assert torch.equal(twin.lm_head, dequantize(model.lm_head, torch.float32))


def test_the_gpu_scripts_knob_variants_parse():
    """engine/bench/quantized_gpu.sh's knobs stage names variants that --variants takes (a typo
    there would cost a GPU call)."""
    import re
    from pathlib import Path

    from engine.bench.decode import parse_variants

    script = (Path(__file__).parents[2] / "engine" / "bench" / "quantized_gpu.sh").read_text()
    for quant in ("bf16", "int4", "fp8"):
        spec = "".join(re.findall(rf'knobs_{quant}\+?="([^"]*)"', script))
        variants = parse_variants(spec)
        assert len(variants) >= 5 and any(v.knobs for v in variants), spec
