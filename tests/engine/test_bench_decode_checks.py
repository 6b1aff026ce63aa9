"""engine.bench.decode's check of the fused steps, on the CPU (Triton's interpreter)."""

import torch

from engine.bench.decode import fused_against_unfused
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
