"""Decode speed of an expert-parallel model (engine.model.expert_parallel) on random weights of a
real shape, one process per GPU (NCCL on CUDA, gloo on CPU):

    torchrun --nproc-per-node 4 -m engine.bench.expert_parallel --random-shape qwen3-235b-a22b

Rank 0 prints decode tokens/s at batch 1 and 8 as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from engine.loading.loader import DTYPES, resolve_dtype
from engine.loading.random_model import SHAPES, random_model
from engine.model import expert_parallel as parallel
from engine.model.config import ModelConfig
from engine.model.options import MOE_PATHS, ModelOptions
from engine.model.qwen3_moe import Qwen3MoeModel


def random_model_shard(
    config: dict,
    dtype,
    device,
    layers: int | None = None,
    group=None,
    seed: int = 0,
    moe_path: str = "auto",
) -> Qwen3MoeModel:
    """This rank's share of a random-weight model; replicated weights broadcast from rank 0."""
    config = dict(config, **({"num_hidden_layers": layers} if layers else {}))
    experts = parallel.rank_experts(config["num_experts"], group)
    local = random_model(
        dict(config, num_experts=len(experts)), dtype=dtype, device=device, seed=seed
    )
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for layer in local.layers:
        if layer.router is not None:  # every rank routes over all the experts
            layer.router = torch.empty(
                config["num_experts"], config["hidden_size"], dtype=dtype, device=device
            )
            if dist.get_rank(group) == 0:
                layer.router.normal_(0, config["hidden_size"] ** -0.5)
        for name, tensor in vars(layer).items():
            if tensor is not None and (layer.router is None or name not in ("w_gate_up", "w_down")):
                dist.broadcast(tensor, src, group=group)
    for tensor in {id(t): t for t in (local.embed, local.lm_head, local.final_norm)}.values():
        dist.broadcast(tensor, src, group=group)
    model = Qwen3MoeModel(
        ModelConfig.from_dict(config),  # the global expert count
        local.embed,
        local.layers,
        local.final_norm,
        local.lm_head,
        ModelOptions(moe_path=moe_path),
    )
    return parallel.shard(model, experts, group)


def bench_decode(model: Qwen3MoeModel, batch: int, context: int = 128, steps: int = 32) -> dict:
    """Decode tok/s of `batch` sequences after a `context`-token prefill (same on every rank)."""
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(
        model.device
    )
    positions = torch.arange(context, device=model.device)[None].expand(batch, context)
    cache = model.new_cache(batch, capacity=context + steps + 1)
    step = model.forward(tokens, positions, cache, last_only=True)[:, -1].argmax(-1)[:, None]
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        pos = torch.full((batch, 1), context + i, device=model.device)
        step = model.forward(step, pos, cache)[:, -1].argmax(-1)[:, None]
    sync()
    elapsed = time.perf_counter() - t0
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": 1000 * elapsed / steps,
        "tok_s": batch * steps / elapsed,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.bench.expert_parallel", description=__doc__.split("\n")[0]
    )
    p.add_argument("--random-shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--layers", type=int, help="only this many layers")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--moe-path", choices=MOE_PATHS, default="auto")
    args = p.parse_args(argv)
    device = parallel.init_distributed(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        model = random_model_shard(
            SHAPES[args.random_shape], dtype, device, layers=args.layers, moe_path=args.moe_path
        )
        results = [bench_decode(model, batch) for batch in (1, 8)]
        if dist.get_rank() == 0:
            report = {
                "world_size": dist.get_world_size(),
                "shape": args.random_shape,
                "dtype": str(dtype),
                "layers": model.config.num_layers,
                "results": results,
            }
            print(json.dumps(report))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
