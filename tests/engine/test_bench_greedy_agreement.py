"""engine.bench.greedy_agreement on the embedded model: every task completed by each arm, the
lean step's answers compared with the general path's."""

import pytest
import torch

from engine.bench import greedy_agreement
from engine.model.lean_matrices import int8_available
from engine.models import embedded_model_dir

DOCS = [
    (
        f"python-stdlib:m{k}.py",
        "".join(f"def f{i}(x):\n    return x * {i} + {k}\n\n" for i in range(9)),
    )
    for k in range(2)
]


@pytest.mark.parametrize("form", ["fp32", "int8"])
def test_each_arm_completes_every_task(form):
    if form == "int8" and not int8_available():
        pytest.skip("this torch lacks the int8 weight-only product")
    summary, rows = greedy_agreement.measure(embedded_model_dir(), DOCS, 2, form)
    assert summary["tasks"] == len(rows) == 4
    assert set(summary) == {"tasks", "general", "lean"}  # no guard outside the int4 form
    assert summary["general"]["differ"] == 0
    for name in ("general", "lean"):
        assert summary[name]["ms"] > 0
        assert summary[name]["exact"] == sum(r[name]["exact"] for r in rows)
        assert summary[name]["differ"] == sum(r[name]["text"] != r["general"]["text"] for r in rows)
    assert sum(bool(r["general"]["text"]) for r in rows) >= 2  # not a vacuous comparison


def test_the_bf16_arm_is_the_general_path_in_bf16():
    general_bf16, guarded = greedy_agreement.arms(embedded_model_dir(), "fp32", bf16=True)[
        "general-bf16"
    ]
    assert general_bf16.dtype == torch.bfloat16 and not general_bf16.lean_path_applies()
    assert not guarded
    summary, rows = greedy_agreement.measure(embedded_model_dir(), DOCS, 1, "fp32", bf16=True)
    assert set(summary) == {"tasks", "general", "lean", "general-bf16"}
    assert summary["general-bf16"]["differ"] == sum(
        r["general-bf16"]["text"] != r["general"]["text"] for r in rows
    )
    assert all(r["general-bf16"]["text"] for r in rows)  # it completes, in its own arithmetic
