"""engine.bench.lean_deviation: the routing gap it reads and the steps it measures, on the
embedded model with int8 decode weights (whose step strays from fp32's by rounding)."""

import json
import math

import pytest

from engine.bench import lean_deviation
from engine.model import lean_cpu
from engine.model.lean_matrices import int4_available, int8_available
from engine.models import embedded_model_dir


def test_the_closest_route_is_the_smallest_gap_at_the_top_k_boundary():
    rows = [[0.5, 2.0, 1.0, 1.25], [3.0, 0.0, 2.9, 2.0]]
    # top-2 of row 0: 2.0, 1.25 (next 1.0): 0.25; of row 1: 3.0, 2.9 (next 2.0): 0.9
    assert lean_cpu.closest_route(rows, 2) == pytest.approx(0.25)
    assert lean_cpu.closest_route([[1.0, 2.0]], 2) == math.inf  # nothing left out


def test_routing_is_watched_only_inside_the_block():
    original = lean_cpu._router_logits
    with lean_deviation.watching_routing(1) as seen:
        assert lean_cpu._router_logits is not original
    assert lean_cpu._router_logits is original and seen == []


@pytest.mark.skipif(not int8_available(), reason="this torch lacks the int8 weight-only product")
def test_each_step_compares_the_lean_logits_with_the_general_paths(tmp_path):
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(12))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "lang": "python", "text": text[i:]}) + "\n" for i in (0, 5)
        )
    )
    rows, recomputed = lean_deviation.measure(embedded_model_dir(), heldout, 2, 3, "int8")
    assert recomputed == 0  # only the int4 form checks its steps
    assert len(rows) == 6
    assert [r["route"] == math.inf for r in rows] == [True, False, False] * 2  # after the prompt
    stepped = [r for r in rows if r["route"] != math.inf]
    assert all(0 < r["route"] < math.inf and r["gap"] >= 0 for r in stepped)
    assert all(0 < r["move"] < 1.0 for r in rows)  # int8 rounding moves logits, a little


@pytest.mark.skipif(not int4_available(), reason="this torch lacks the CPU int4 product")
def test_router_noise_compares_each_layers_routing_with_the_fp32_recompute():
    import torch

    from engine.loading.random_model import TINY, random_model

    model = random_model(
        dict(TINY, vocab_size=512), dtype=torch.float32, seed=31, quant="int4", quant_size=32
    ).dequantized()
    model = model.with_options(lean_weights="int4")
    ids = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    per_layer = lean_deviation.router_noise(model, ids, 4)
    assert len(per_layer) == model.config.num_layers
    assert all(len(rows) == 4 for rows in per_layer)
    changes = [r["change"] for rows in per_layer for r in rows]
    # bf16 activations move the router's logits a little, never by much on this scale
    assert 0 < max(changes) < 0.5 and all(r["gap"] >= 0 for rows in per_layer for r in rows)
    summary = lean_deviation._per_layer_summary(per_layer)
    assert [s["layer"] for s in summary] == list(range(model.config.num_layers))
    assert all(s["change_p50"] <= s["change_p99"] <= s["change_max"] for s in summary)
