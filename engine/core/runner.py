"""The model runner: executes what the scheduler planned on the model, over the KV pool.

It builds each forward's batch (tokens, positions, the block tables' view of the pool) and picks
how it runs: a captured CUDA graph where one fits (decode steps, short prompt tails), else the
model's eager forward; a draft's verify rows and a beam search's beams take the lean CPU path
(`forward_tail`, `forward_beams`). It chooses no tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.core.options import EngineOptions
from engine.core.state import RequestState
from engine.decoding.beam_search import BeamTails
from engine.kv.pool import KVPool, PagedBatch
from engine.model.qwen3_moe import Qwen3MoeModel

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: Qwen3MoeModel, options: EngineOptions, vocab_limit: int | None):
        cfg = model.config
        self.model = model
        block_size, num_blocks = options.block_size, options.num_blocks
        if num_blocks is None:
            per_token = KVPool(
                cfg.num_layers,
                1,
                1,
                cfg.num_kv_heads,
                cfg.head_dim,
                model.dtype,
                "meta",
                options.kv_fp8,
            )
            per_block = per_token.bytes_per_token() * block_size
            num_blocks = max(1, options.kv_memory_bytes // per_block)
        self.pool = KVPool(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.dtype,
            model.device,
            options.kv_fp8,
        )
        model.prepare_lone_decode()  # CPU: at engine start, not in the first completion
        self.graphs = None  # CUDA: decode steps and short prompt tails replay captured graphs
        if options.cuda_graphs and model.device.type == "cuda" and cfg.sliding_window is None:
            from engine.model.cuda_graph import DecodeGraphs

            max_tokens = min(cfg.max_position_embeddings, num_blocks * block_size)
            self.graphs = DecodeGraphs(model, self.pool, max_tokens, vocab_limit)
            t0 = time.monotonic()
            self.graphs.capture_all()
            log.info(
                "captured %d decode graphs in %.1f s",
                len(self.graphs.graphs),
                time.monotonic() - t0,
            )

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def beams_apply(self) -> bool:
        """Whether a beam search can run: its beams' lean forward reads the prompt's K/V in place
        (no fp8 pool) on the CPU's lean path, never inside captured graphs."""
        return self.graphs is None and not self.pool.fp8 and self.model.lone_path_applies()

    def prefill(
        self, a: RequestState, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute prompt tokens [start, end): the last row's logits [V], and its greedy id where
        the device already took it."""
        prompt = a.request.prompt_ids
        a.table.prepare_write(start, end)
        if self.graphs is not None and end - start <= self.graphs.max_rows:
            # A short tail after a cache hit: one graph replay, a row per new token.
            logits, greedy = self.graphs.run(
                prompt[start:end], list(range(start, end)), [a.table.blocks] * (end - start)
            )
            return logits[-1], greedy[-1]
        device = self.model.device
        tokens = torch.tensor([prompt[start:end]], device=device)
        positions = torch.arange(start, end, device=device)[None]
        view = PagedBatch(self.pool, [a.table.blocks], device)
        return self.model.forward(tokens, positions, view, last_only=True)[0, -1], None

    def decode(self, batch: list[RequestState]) -> tuple[torch.Tensor, list[int] | None]:
        """One token of each sequence: logits [B, V], and the greedy ids where the device took
        them."""
        for a in batch:
            a.table.prepare_write(a.computed, a.computed + 1)
        if self.graphs is not None and len(batch) <= self.graphs.max_rows:
            logits, greedy = self.graphs.run(
                [a.tokens[-1] for a in batch],
                [a.computed for a in batch],
                [a.table.blocks for a in batch],
            )
            return logits, greedy.tolist()  # one device-to-host copy for the whole batch
        device = self.model.device
        tokens = torch.tensor([[a.tokens[-1]] for a in batch], device=device)
        positions = torch.tensor([[a.computed] for a in batch], device=device)
        view = PagedBatch(self.pool, [a.table.blocks for a in batch], device)
        return self.model.forward(tokens, positions, view)[:, -1], None

    def verify(self, a: RequestState, rows: list[int]) -> torch.Tensor | None:
        """A draft's rows (the last token, then the draft) on the lean path, written from
        `a.computed` on: logits [rows, V], or None where the lean path declines."""
        a.table.prepare_write(a.computed, a.computed + len(rows))
        view = PagedBatch(self.pool, [a.table.blocks], self.model.device)
        return self.model.forward_tail(rows, a.computed, view)

    def beam_step(self, a: RequestState, tokens: list[int], tails: BeamTails) -> torch.Tensor:
        """The beams' new tokens over the prompt's shared blocks (never written) and their own
        tails: logits [beams, V]."""
        view = PagedBatch(self.pool, [a.table.blocks], self.model.device)
        return self.model.forward_beams(tokens, a.computed + tails.length, view, tails)
