"""Expert parallelism: each rank holds a contiguous range of every MoE layer's experts.

Attention, norms, routers, dense layers, embeddings and the KV cache are replicated: every rank
runs the same forward on the same tokens. Only the MoE layer differs: the rank's model computes
it with `ExpertParallelMoE` (its `ModelOptions.moe_fn`, set by `shard`), which sums the local
experts' contributions to every token's output (the other ranks' slots count as weight 0), and
one fp32 `all_reduce` (sum) of the [T, H] output combines them. That suits warp decode: the
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
deterministic, so greedy generation agrees on every rank and stops at the same step. The
`parallel` command of `wd-engine` (one process per GPU under torchrun) relies on that: every
rank runs the engine's loop on the same request, and rank 0 prints the text.
`engine.bench.expert_parallel` measures decode steps on random weights of a real shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.model.layer import CPU_OUTPUT_CENTRIC_MAX_PAIRS
from engine.model.qwen3_moe import Qwen3MoeModel
from kernels import dispatch
from kernels import reference as ref


def expert_range(num_experts: int, rank: int, world_size: int) -> range:
    """Rank's contiguous share of the experts; the first `E % world_size` ranks get one more."""
    base, extra = divmod(num_experts, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def init_distributed(device: str | None = None) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    LOCAL_RANK); this rank's device."""
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


@dataclass(frozen=True)
class ExpertParallelMoE:
    """The MoE function (`ModelOptions.moe_fn`) of a rank holding experts
    [experts.start, experts.stop) of every layer's `num_experts`. `path` forces a path as the
    model's `moe_path` does on one process."""

    experts: range
    num_experts: int
    device: torch.device
    path: str = "auto"
    group: dist.ProcessGroup | None = None

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
        if self.path == "expert_centric":
            return dispatch.EXPERT_CENTRIC
        if self.path == "output_centric":
            return dispatch.WARP_DECODE
        if self.device.type == "cuda":
            # The measured crossover is for the whole layer; the local share scales tokens*k and E
            # alike, so the same (tokens, k, E) entry decides.
            return dispatch.choose_path(tokens, top_k, self.num_experts)
        if tokens * top_k <= CPU_OUTPUT_CENTRIC_MAX_PAIRS:
            return dispatch.WARP_DECODE
        return dispatch.EXPERT_CENTRIC


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
    """Each local (token, slot) pair as a one-expert row of the grouped path; fp32 [T, H]
    partial."""
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
    """`model` (whose MoE layers hold only `experts`) as an expert-parallel rank: the same
    weights, its MoE by `ExpertParallelMoE` on the path its options' `moe_path` names."""
    moe = ExpertParallelMoE(
        experts, model.config.num_experts, model.device, model.options.moe_path, group
    )
    return model.with_options(moe_fn=moe)


def rank_experts(num_experts: int, group=None) -> range:
    """This rank's share of `num_experts` (`expert_range` of its rank in the process group): the
    experts to load (`engine.loading.loader.load_model(..., experts=)`) before `shard`."""
    return expert_range(num_experts, dist.get_rank(group), dist.get_world_size(group))
