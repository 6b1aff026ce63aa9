"""engine.bench.projections' checks run on the CPU (Triton's interpreter) at the tiny shape."""

import json

from engine.bench.projections import main, projection_sizes
from engine.loading.random_model import SHAPES


def test_projection_gemvs_match_float64_at_every_format(tmp_path):
    out = tmp_path / "projections.json"
    # The lm_head's 16,000 outputs take half a minute in the interpreter: the same kernel.
    args = ["--shape", "tiny", "--device", "cpu", "--rows", "3", "--projections", "qkv,o"]
    assert main([*args, "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 2 * 3
    assert all(0 < c["error"] < 1e-2 for c in cases), cases  # bf16 output rounding
    sizes = projection_sizes(SHAPES["tiny"])
    assert {(c["proj"], c["out"], c["k"]) for c in cases} == {(p, *sizes[p]) for p in ("qkv", "o")}
    assert sizes["lm_head"] == (SHAPES["tiny"]["vocab_size"], SHAPES["tiny"]["hidden_size"])
