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
from engine.decoding.token_healing import Forcing
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
        model.prepare_lean_decode()  # CPU: at engine start, not in the first completion
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

    def lean_rows_apply(self) -> bool:
        """Whether a few rows of one sequence run on the lean CPU forward (a draft's verify, a beam
        search's beams): it reads the pool's K/V in place (no fp8 pool), never inside captured
        graphs."""
        return self.graphs is None and not self.pool.fp8 and self.model.lean_path_applies()

    def prefill(
        self, state: RequestState, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute prompt tokens [start, end): the last row's logits [V], and its greedy id where
        the device already took it."""
        prompt = state.request.prompt_ids
        state.table.prepare_write(start, end)
        if self.graphs is not None and end - start <= self.graphs.max_rows:
            # A short tail after a cache hit: one graph replay, a row per new token.
            logits, greedy = self.graphs.run(
                prompt[start:end], list(range(start, end)), [state.table.blocks] * (end - start)
            )
            return logits[-1], greedy[-1]
        device = self.model.device
        tokens = torch.tensor([prompt[start:end]], device=device)
        positions = torch.arange(start, end, device=device)[None]
        view = PagedBatch(self.pool, [state.table.blocks], device)
        logits = self.model.forward(
            tokens, positions, view, last_only=True, exact_logits=_constrained(state.forcing)
        )
        return logits[0, -1], None

    def decode(self, batch: list[RequestState]) -> tuple[torch.Tensor, list[int] | None]:
        """One token of each sequence: logits [B, V], and the greedy ids where the device took
        them."""
        for state in batch:
            state.table.prepare_write(state.computed, state.computed + 1)
        if self.graphs is not None and len(batch) <= self.graphs.max_rows:
            logits, greedy = self.graphs.run(
                [state.tokens[-1] for state in batch],
                [state.computed for state in batch],
                [state.table.blocks for state in batch],
            )
            return logits, greedy.tolist()  # one device-to-host copy for the whole batch
        device = self.model.device
        tokens = torch.tensor([[state.tokens[-1]] for state in batch], device=device)
        positions = torch.tensor([[state.computed] for state in batch], device=device)
        view = PagedBatch(self.pool, [state.table.blocks for state in batch], device)
        exact = any(_constrained(state.forcing) for state in batch)
        return self.model.forward(tokens, positions, view, exact_logits=exact)[:, -1], None

    def verify(self, state: RequestState, rows: list[int]) -> torch.Tensor | None:
        """A draft's rows (the last token, then the draft) on the lean path, written from
        `a.computed` on: logits [rows, V], or None where the lean path declines."""
        state.table.prepare_write(state.computed, state.computed + len(rows))
        view = PagedBatch(self.pool, [state.table.blocks], self.model.device)
        return self.model.forward_tail(rows, state.computed, view)

    def beam_step(self, state: RequestState, tokens: list[int], tails: BeamTails) -> torch.Tensor:
        """The beams' new tokens over the prompt's shared blocks (never written) and their own
        tails: logits [beams, V]."""
        view = PagedBatch(self.pool, [state.table.blocks], self.model.device)
        exact = any(_constrained(hyp.forcing) for hyp in state.beam.search.live)
        return self.model.forward_beams(
            tokens, state.computed + tails.length, view, tails, exact_logits=exact
        )


def _constrained(forcing: Forcing | None) -> bool:
    """Whether a choice is constrained to a healed text, so may pick a token far from the best
    logit: the logits must be exact there, not only near the best."""
    return forcing is not None and forcing.active
