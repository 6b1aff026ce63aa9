"""Expert parallelism: each rank holds a contiguous range of every MoE layer's experts.

Attention, norms, routers, dense layers, embeddings and the KV cache are replicated: every rank
runs the same forward on the same tokens. Only the MoE layer differs — each rank computes its
local experts' contributions to every token's output (the other ranks' slots count as weight 0),
and one fp32 `all_reduce` (sum) of the [T, H] output combines them. That suits warp decode: the
kernel is already organised around outputs, so a rank simply sums fewer experts per output.

- Decode (few routed pairs): each token's local slots are moved to the front and the slot list is
  cut to the largest local count, so warp decode reads only local experts (padding slots repeat a
  row the token already reads, with weight 0).
- Prefill (many pairs): every local (token, slot) pair becomes a one-expert row for the
  expert-centric path; outputs are summed per token in fp32. Since attention is replicated, every
  rank already holds every token, so "dispatch" is a local gather and the combine is the same
  all_reduce. An all-to-all token dispatch only pays once attention is data-parallel (each rank
  holding different sequences); that is the next step at scale, not built here.

Driving it: every rank must make the same sequence of `forward` calls (each MoE layer is a
collective). All-reduce results are identical on every rank and the replicated compute is
deterministic, so greedy generation agrees on every rank and stops at the same step; the entry
point below relies on that. For the daemon, rank 0 runs scheduler and server unchanged on a model
whose `forward` first broadcasts its arguments (tokens, positions, block tables, last_only, and any
KV block copies the allocator made) to the other ranks, which loop on receive -> the same
`forward` on their own replica of the KV pool; only rank 0 samples and answers clients.

Launch (one process per GPU; NCCL on CUDA, gloo on CPU):
    torchrun --nproc-per-node 2 -m engine.model.expert_parallel --model DIR --prompt 'def f(' --max-tokens 32
    torchrun --nproc-per-node 4 -m engine.model.expert_parallel --random-shape qwen3-235b-a22b --bench
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from engine.model.qwen3_moe import CPU_OUTPUT_CENTRIC_MAX_PAIRS, Qwen3MoeModel
from engine.model.random_model import SHAPES, random_model
from kernels import dispatch
from kernels import reference as ref


def expert_range(num_experts: int, rank: int, world_size: int) -> range:
    """Rank's contiguous share of the experts; the first `E % world_size` ranks get one more."""
    base, extra = divmod(num_experts, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def init_distributed(device: str | None = None) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK)."""
    # NVLink multicast (NVLS / symmetric memory) can put the GPUs of a shared host out of service.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    return dev


class ExpertParallelMoE:
    """The model's `moe_fn` on a rank holding experts [experts.start, experts.stop) of every layer."""

    def __init__(self, model: Qwen3MoeModel, experts: range, group=None):
        self.model = model  # read for `moe_path`, so forcing a path works as on one process
        self.experts = experts
        self.group = group

    def __call__(self, x, w_gate_up, w_down, topk_ids, topk_weights) -> torch.Tensor:
        lo, hi = self.experts.start, self.experts.stop
        local = (topk_ids >= lo) & (topk_ids < hi)
        path = self._path(*topk_ids.shape)
        if path == dispatch.EXPERT_CENTRIC:
            out = _expert_centric_local(x, w_gate_up, w_down, topk_ids - lo, topk_weights, local)
        else:
            out = _output_centric_local(
                path, x, w_gate_up, w_down, topk_ids - lo, topk_weights, local
            )
        dist.all_reduce(out, group=self.group)  # every rank calls it, even with no local slot
        return out.to(x.dtype)

    def _path(self, tokens: int, top_k: int) -> str:
        forced = self.model.moe_path
        if forced == "expert_centric":
            return dispatch.EXPERT_CENTRIC
        if forced == "output_centric":
            return dispatch.WARP_DECODE
        if self.model.device.type == "cuda":
            # The measured crossover is for the whole layer; the local share scales tokens*k and E
            # alike, so the same (tokens, k, E) entry decides.
            return dispatch.choose_path(tokens, top_k, self.model.config.num_experts)
        return (
            dispatch.WARP_DECODE
            if tokens * top_k <= CPU_OUTPUT_CENTRIC_MAX_PAIRS
            else dispatch.EXPERT_CENTRIC
        )


def _output_centric_local(path, x, w_gate_up, w_down, ids, weights, local) -> torch.Tensor:
    """Warp decode over the local slots only; fp32 [T, H] partial output."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    # Local slots first (stable), then cut to the largest local count: one host sync per layer.
    order = torch.argsort((~local).to(torch.uint8), dim=1, stable=True)
    width = int(local.sum(dim=1).max())
    if width == 0:
        return out
    local = local.gather(1, order)[:, :width]
    ids = ids.gather(1, order)[:, :width]
    # Padding slots repeat the token's first slot (rows it already reads) with weight 0; a token
    # with no local slot at all reads a clamped in-range expert, also with weight 0.
    ids = torch.where(local, ids, ids[:, :1]).clamp(0, w_gate_up.shape[0] - 1)
    weights = torch.where(local, weights.gather(1, order)[:, :width], 0.0)
    if x.is_cuda:
        y = dispatch.run_path(path, x, w_gate_up, w_down, ids, weights)
    else:
        y = ref.moe_output_centric(x, w_gate_up, w_down, ids, weights)
    return out.add_(y.float())


def _expert_centric_local(x, w_gate_up, w_down, ids, weights, local) -> torch.Tensor:
    """Each local (token, slot) pair as a one-expert row of the grouped path; fp32 [T, H] partial."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    tokens, slots = local.nonzero(as_tuple=True)
    if tokens.numel() == 0:
        return out
    args = (
        x[tokens],
        w_gate_up,
        w_down,
        ids[tokens, slots][:, None],
        weights[tokens, slots][:, None],
    )
    if x.is_cuda:
        y = dispatch.run_path(dispatch.EXPERT_CENTRIC, *args)
    else:
        y = ref.moe_expert_centric(*args)
    return out.index_add_(0, tokens, y.float())


def shard(model: Qwen3MoeModel, experts: range, group=None) -> Qwen3MoeModel:
    """Make `model` (whose MoE layers hold only `experts`) an expert-parallel rank."""
    model.moe_fn = ExpertParallelMoE(model, experts, group)
    return model


def load_model_shard(model_dir, dtype=None, device="cpu", group=None) -> Qwen3MoeModel:
    """This rank's model: replicated layers plus only its own experts, read from the safetensors."""
    from engine.loading.loader import load_model
    from engine.model.config import ModelConfig

    experts = expert_range(
        ModelConfig.from_dir(model_dir).num_experts,
        dist.get_rank(group),
        dist.get_world_size(group),
    )
    return shard(load_model(model_dir, dtype=dtype, device=device, experts=experts), experts, group)


# -- random weights of a real shape, for measuring ----------------------------------------------
def random_model_shard(
    config: dict, dtype, device, layers: int | None = None, group=None, seed: int = 0
):
    """This rank's share of a random-weight model; replicated weights broadcast from rank 0."""

    config = dict(config, **({"num_hidden_layers": layers} if layers else {}))
    experts = expert_range(config["num_experts"], dist.get_rank(group), dist.get_world_size(group))
    model = random_model(
        dict(config, num_experts=len(experts)), dtype=dtype, device=device, seed=seed
    )
    model.config = type(model.config).from_dict(config)  # the global expert count
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for layer in model.layers:
        if layer.router is not None:
            layer.router = torch.empty(
                config["num_experts"], config["hidden_size"], dtype=dtype, device=device
            )
            if dist.get_rank(group) == 0:
                layer.router.normal_(0, config["hidden_size"] ** -0.5)
        for name, tensor in vars(layer).items():
            if tensor is not None and (layer.router is None or name not in ("w_gate_up", "w_down")):
                dist.broadcast(tensor, src, group=group)
    for tensor in {id(t): t for t in (model.embed, model.lm_head, model.final_norm)}.values():
        dist.broadcast(tensor, src, group=group)
    return shard(model, experts, group)


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
        prog="python -m engine.model.expert_parallel", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="Hugging Face Qwen3-MoE folder")
    p.add_argument(
        "--random-shape", choices=sorted(SHAPES), help="random weights of this shape (with --bench)"
    )
    p.add_argument("--layers", type=int, help="with --random-shape: only this many layers")
    p.add_argument("--prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument(
        "--moe-path", choices=("auto", "expert_centric", "output_centric"), default="auto"
    )
    p.add_argument(
        "--bench", action="store_true", help="print decode tok/s at batch 1 and 8 as JSON"
    )
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.random_shape):
        p.error("give exactly one of --model DIR or --random-shape NAME")
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from engine.loading.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    if args.random_shape:
        model = random_model_shard(SHAPES[args.random_shape], dtype, device, layers=args.layers)
    else:
        model = load_model_shard(args.model, dtype=dtype, device=device)
    model.moe_path = args.moe_path
    try:
        if args.bench:
            results = [bench_decode(model, batch) for batch in (1, 8)]
            if rank == 0:
                print(
                    json.dumps(
                        {
                            "world_size": world,
                            "shape": args.random_shape or args.model,
                            "dtype": str(dtype),
                            "layers": model.config.num_layers,
                            "results": results,
                        }
                    )
                )
        elif args.model and args.prompt is not None:
            from engine.core.generate import complete
            from engine.loading.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(args.model, extra_eos_ids=model.config.eos_token_ids)
            text, stats = complete(
                model, tokenizer, tokenizer.encode(args.prompt), max_tokens=args.max_tokens
            )
            # Every rank decoded the same tokens; check it rather than trust it.
            seen = [None] * world
            dist.all_gather_object(seen, stats.token_ids)
            if any(s != seen[0] for s in seen):
                raise RuntimeError(f"ranks disagree on the completion: {seen}")
            if rank == 0:
                sys.stdout.write(text)
                sys.stdout.flush()
        else:
            p.error("give --prompt TEXT with --model, or --bench")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
