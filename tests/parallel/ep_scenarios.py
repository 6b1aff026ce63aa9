"""The forward calls both sides of the expert-parallel test make: one process and every rank."""

from __future__ import annotations

import torch
from engine_runs import complete

PROMPTS = [
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]
DECODE_STEPS = 4
GREEDY_TOKENS = 12


def run(model, tokenizer, shard=lambda model: model) -> dict:
    """Logits of a ragged prefill and of batched decode steps for each MoE path; greedy tokens.
    `shard` makes a model of each path an expert-parallel rank (the ranks' side)."""
    results = {}
    rows = [tokenizer.encode(p) for p in PROMPTS]
    lengths = torch.tensor([len(r) for r in rows])
    width = int(lengths.max())
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    positions = torch.arange(width)[None].expand(len(rows), width)
    for path in ("auto", "expert_centric", "output_centric"):
        path_model = shard(model.with_options(moe_path=path))
        cache = path_model.new_cache(len(rows), capacity=width + DECODE_STEPS)
        logits = path_model.forward(tokens, positions, cache)
        results[f"{path}/prefill"] = logits
        step = logits[torch.arange(len(rows)), lengths - 1].argmax(-1)
        pos = lengths.clone()
        for i in range(DECODE_STEPS):  # each row continues right after its own prompt
            logits = path_model.forward(step[:, None], pos[:, None], cache)
            results[f"{path}/decode{i}"] = logits
            step, pos = logits[:, -1].argmax(-1), pos + 1
    auto = shard(model.with_options(moe_path="auto"))
    for i, row in enumerate(rows):
        _, done = complete(auto, tokenizer, row, max_tokens=GREEDY_TOKENS, stop_at_eos=False)
        results[f"greedy{i}"] = done.token_ids
    return results
