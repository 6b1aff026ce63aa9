"""The decode step on CUDA: fused small ops over static buffers, replayed as CUDA graphs.

At small batch a decode step is bound by kernel launches, not by the bytes it reads: the
eager forward launches ~50 kernels per layer from Python. `DecodeStep` runs the same model
with eleven per layer over static input buffers, so one CUDA graph per bucket of rows can
replay a whole step with no Python in between. With every fusion of engine.model.step_kernels
it is seven (the q/k/v projection with the residual add and RMSNorm before it, q/k norm + RoPE
+ KV store, paged attention with its merge, the o projection, add + RMSNorm + router + top-k,
warp decode's two kernels), linked by programmatic dependent launch; the engine turns each on
once a GPU measurement has checked it, per weight format (step_kernels.default_fusions). The
captured step and the eager one are the same code (`DecodeStep.__call__`): the CUDA backend's
decoder layer, over the model's `LayerWeights` and with the general layer's `mlp`
(engine.model.layer), whose MoE path the model's options choose.

A row is one query token with its own block table and length. Rows are a batch of decode
steps, or several new tokens of one sequence (each row ends at its own position, so the
attention stays causal): a warm prompt's last few tokens run through the same graphs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.kv.pool import KVPool
from engine.model.layer import mlp
from engine.model.qwen3_moe import Qwen3MoeModel
from engine.model.step_kernels import DEFAULT_KERNELS, StepKernels, StepOps, step_format
from kernels import reference as ref
from kernels.fused_ops import AttentionHeads, add_rms_norm
from kernels.paged_attention import default_splits
from kernels.quant_linear import linear

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 3, 4, 8, 16, 32)  # 3: a warm prompt's usual tail (typed text + FIM token)


class DecodeStep:
    """One forward of `rows` query tokens against the paged KV cache, from static buffers."""

    def __init__(
        self,
        model: Qwen3MoeModel,
        pool: KVPool,
        rows: int,
        max_blocks: int,
        vocab_limit: int | None = None,
        kernels: StepKernels = DEFAULT_KERNELS,
    ):
        cfg = model.config
        device = model.device
        self.model, self.pool, self.rows, self.vocab_limit = model, pool, rows, vocab_limit
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.lengths = torch.ones(rows, dtype=torch.int32, device=device)
        # The split count fixes the attention grid; each row's keys are shared out by its length.
        self.n_splits = kernels.n_splits or default_splits(
            rows, cfg.num_kv_heads, max_blocks * pool.block_size
        )
        if pool.fp8:  # k/v go to a scratch first, then through the pool's quantising write
            shape = (rows, cfg.num_kv_heads, cfg.head_dim)
            self.k_scratch = torch.empty(shape, dtype=model.dtype, device=device)
            self.v_scratch = torch.empty(shape, dtype=model.dtype, device=device)
            self.scratch_slots = torch.arange(rows, device=device)
        self.ops = StepOps(
            kernels,
            rows,
            cfg.num_kv_heads,
            cfg.rms_norm_eps,
            device,
            step_format(model.layers[0].w_qkv, model.layers[0].w_o),
        )
        self.logits: torch.Tensor | None = None  # [rows, V] fp32, written by each call
        self.greedy: torch.Tensor | None = None  # [rows] argmax of the logits

    def load(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """Copy a step's inputs into the static buffers. Rows past len(tokens) are padding:
        copies of row 0 (same experts, so no extra weight traffic) that store their K/V in the
        pool's scratch block, which no sequence owns."""
        n, bs = len(tokens), self.pool.block_size
        if not 0 < n <= self.rows:
            raise ValueError(f"{n} rows do not fit a step of {self.rows}")
        pad = self.rows - n
        tokens, positions, tables = (
            list(tokens) + tokens[:1] * pad,
            list(positions) + positions[:1] * pad,
            list(tables) + tables[:1] * pad,
        )
        width = max(len(t) for t in tables)
        if width > self.tables.shape[1]:
            raise ValueError(
                f"block table of {width} blocks; the step was built for {self.tables.shape[1]}"
            )
        for table, position in zip(tables, positions):
            if position // bs >= len(table):
                raise ValueError(f"position {position} is past the row's {len(table)} blocks")
        # One conversion for all rows (this runs every step); short rows repeat their last block,
        # which is never read (past the row's length).
        host = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables], dtype=torch.int32)
        pos = torch.tensor(positions)
        slots = host.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        slots[n:] = self.pool.scratch_block * bs + torch.arange(pad) % bs
        self.tokens.copy_(torch.tensor(tokens))
        self.positions.copy_(pos)
        self.slots.copy_(slots)
        self.lengths.copy_((pos + 1).to(torch.int32))
        self.tables[:, :width].copy_(host)

    @torch.inference_mode()
    def __call__(self) -> None:
        model, pool, cfg, ops = self.model, self.pool, self.model.config, self.ops
        x = F.embedding(self.tokens, model.embed)  # [rows, H]: the residual stream
        cos, sin = ref.rope_cos_sin(self.positions, model.inv_freq, model.dtype)  # [rows, D]
        delta = None  # the last sublayer's output, not yet added to x
        for index, layer in enumerate(model.layers):
            x, q = ops.attention_inputs(
                x,
                delta,
                layer.input_norm,
                layer.w_qkv,
                layer.b_qkv,
                self._heads(index, layer, cos, sin),
            )
            if pool.fp8:  # the new K/V went to the scratch: quantised into the pool
                pool.write(index, self.slots, self.k_scratch, self.v_scratch)
            scales = (
                (pool.key_scales[index], pool.value_scales[index]) if pool.fp8 else (None, None)
            )
            attn = ops.attention(
                q,
                pool.keys[index],
                pool.values[index],
                self.tables,
                self.lengths,
                pool.block_size,
                *scales,
                n_splits=self.n_splits,
            )
            delta = ops.linear(attn.reshape(self.rows, -1), layer.w_o, layer.b_o)
            x, h, routing = ops.norm_route(
                x,
                delta,
                layer.post_attention_norm,
                layer.router,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
            )
            delta = mlp(h, layer, cfg, model.options, routing, pdl=ops.pdl_moe)
        _, h = add_rms_norm(x, delta, model.final_norm, cfg.rms_norm_eps)
        logits = linear(h, model.lm_head).float()
        if self.vocab_limit is not None:
            logits[:, self.vocab_limit :] = float("-inf")  # ids the tokenizer can't decode
        self.logits = logits
        self.greedy = logits.argmax(dim=-1)

    def _heads(self, index, layer, cos, sin) -> AttentionHeads:
        """Where layer `index`'s new q, k and v go: k and v into the pool at the rows' slots,
        or, for an fp8 pool, into the scratch that pool.write then quantises."""
        cfg, pool = self.model.config, self.pool
        if pool.fp8:
            dst = (self.k_scratch, self.v_scratch, self.scratch_slots)
        else:
            dst = (pool.keys[index], pool.values[index], self.slots)
        return AttentionHeads(
            layer.q_norm,
            layer.k_norm,
            cos,
            sin,
            *dst,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.rms_norm_eps,
        )


class DecodeGraphs:
    """Decode steps of 1..32 rows on CUDA, each bucket captured as a CUDA graph on first use.

    `run` loads the inputs, replays the smallest bucket that holds them and returns views of
    that bucket's logits and greedy ids: read them before the next `run`.
    """

    def __init__(
        self,
        model: Qwen3MoeModel,
        pool: KVPool,
        max_tokens: int,
        vocab_limit: int | None = None,
        buckets=ROW_BUCKETS,
        capture: bool = True,
        kernels: StepKernels = DEFAULT_KERNELS,
    ):
        max_blocks = -(-max_tokens // pool.block_size)
        self.steps = {
            rows: DecodeStep(model, pool, rows, max_blocks, vocab_limit, kernels)
            for rows in buckets
        }
        self.capture = capture and model.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.failed: set[int] = set()  # buckets whose capture failed run eagerly
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def max_rows(self) -> int:
        return max(self.steps)

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]):
        """(logits [n, V] fp32, greedy ids [n]) for n = len(tokens) rows."""
        n = len(tokens)
        rows = min(r for r in self.steps if r >= n)
        step = self.steps[rows]
        step.load(tokens, positions, tables)
        graph = self._graph(rows) if self.capture else None
        if graph is None:
            step()
        else:
            graph.replay()
        return step.logits[:n], step.greedy[:n]

    def capture_all(self) -> None:
        """Capture every bucket now (at start-up) rather than on first use. Captures run on
        padding rows only, which write to the scratch block."""
        for rows in sorted(self.steps, reverse=True):  # largest first: the rest reuse its memory
            self.steps[rows].load([0], [0], [[self.steps[rows].pool.scratch_block]])
            self._graph(rows)

    def _graph(self, rows: int) -> torch.cuda.CUDAGraph | None:
        if rows in self.graphs or rows in self.failed:
            return self.graphs.get(rows)
        step = self.steps[rows]
        # Warm up off the capture (Triton compiles, cuBLAS picks its kernels). The loaded inputs
        # are the real step's, so these runs only write the K/V the step itself writes.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                step()
        except Exception:  # noqa: BLE001 - e.g. a MoE path that syncs with the host
            log.exception(
                "CUDA graph capture of the %d-row decode step failed; it runs eagerly", rows
            )
            self.failed.add(rows)
            torch.cuda.synchronize()
            return None
        self.graphs[rows] = graph
        return graph
