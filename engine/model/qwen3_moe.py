"""The Qwen3-MoE model over weights laid out for the kernels: embedding, decoder layers, head.

One `forward` serves prefill (many tokens) and decode (one token per sequence) through the
general layer (engine.model.layer), whose MoE picks its path from the number of routed tokens.
Numerics follow transformers' Qwen3-MoE. The runners of the same layers are chosen at
construction from the model's `ModelOptions` (engine.model.options), never switched afterwards:
on the CPU, a small fp32 model's forwards of a few rows of one sequence (a decode step, a
prompt's few tokens, a speculative draft's verification in
`forward_tail`, a beam search's beams in `forward_beams`)
take the lean CPU forward (engine.model.lean_cpu); on CUDA the engine replays the decode step as
CUDA graphs (engine.model.cuda_graph).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.kv.cache import ModelCache
from engine.kv.contiguous import KVCache
from engine.model import cpu_threads
from engine.model.config import ModelConfig
from engine.model.layer import LayerWeights, decoder_layer
from engine.model.lean_cpu import LEAN_MAX_ROWS, LEAN_PROMPT_MAX_ROWS, BeamKeys, LeanCpu
from engine.model.options import ModelOptions
from kernels import reference as ref
from kernels.quant import dequantize, is_quantized, nbytes
from kernels.quant_linear import linear

# LEAN_MAX_ROWS (engine.model.lean_cpu) is part of the model's interface: the engine sizes its
# speculative drafts and beams by it.
__all__ = ["CPU_SMALL_MODEL_MAX_BYTES", "LEAN_MAX_ROWS", "Qwen3MoeModel"]

# The CPU's lean forward and its one-thread rule (engine.model.cpu_threads) are for small
# models, whose steps are dominated by per-op cost: the lean forward's weight copies double the
# weights' memory, and a big model's step streams enough bytes to gain from every core. Past
# this many weight bytes the general path runs, on every thread.
CPU_SMALL_MODEL_MAX_BYTES = 1 << 30


class Qwen3MoeModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        options: ModelOptions | None = None,
    ):
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.options = options if options is not None else ModelOptions()
        self.dtype = embed.dtype
        self.device = embed.device
        self.inv_freq = ref.rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)
        # Weights kept quantized (kernels.quant): the general path's kernels read them; the lean
        # CPU forward takes plain tensors only.
        self.quantized = any(
            is_quantized(w) for layer in layers for w in vars(layer).values()
        ) or is_quantized(lm_head)
        self.small_on_cpu = (
            self.device.type == "cpu" and weight_bytes(self) <= CPU_SMALL_MODEL_MAX_BYTES
        )
        self.lean = (
            LeanCpu(self, self.options.lean_weights, self.options.lean_guard)
            if self._lean_applies()
            else None
        )

    def with_options(self, **changes) -> Qwen3MoeModel:
        """This model with `changes` to its options (ModelOptions' fields), sharing its weight
        tensors, and its lean forward (its weight copies) where its form and guard stay the same."""
        model = Qwen3MoeModel(
            self.config,
            self.embed,
            self.layers,
            self.final_norm,
            self.lm_head,
            dataclasses.replace(self.options, **changes),
        )
        if (
            model.lean is not None
            and self.lean is not None
            and (model.lean.form, model.lean.guarded) == (self.lean.form, self.lean.guarded)
        ):
            model.lean = self.lean
        return model

    def dequantized(self) -> Qwen3MoeModel:
        """This model with every quantized weight (kernels.quant) dequantized to its dtype: the
        same values, read as plain tensors (the reference the quantized paths are checked
        against)."""

        def plain(w):
            return dequantize(w, self.dtype) if is_quantized(w) else w

        layers = [
            dataclasses.replace(layer, **{name: plain(w) for name, w in vars(layer).items()})
            for layer in self.layers
        ]
        return Qwen3MoeModel(
            self.config, self.embed, layers, self.final_norm, plain(self.lm_head), self.options
        )

    def _lean_applies(self) -> bool:
        options = self.options
        return (
            options.lean_decode
            and self.small_on_cpu
            and not self.quantized
            and self.dtype == torch.float32
            and options.moe_fn is None
            and options.moe_path == "auto"
            and self.config.sliding_window is None
        )

    def lean_path_applies(self) -> bool:
        """Whether the lean CPU forward runs: one sequence's decode steps, its prompts of up to
        LEAN_PROMPT_MAX_ROWS tokens, and the forwards of a few rows (`forward_tail`,
        `forward_beams`)."""
        return self.lean is not None

    def prepare_lean_decode(self) -> None:
        """Build the lean CPU forward's weight copies now rather than in the first completion's
        first step; a no-op where that forward does not apply."""
        if self.lean is not None:
            self.lean.prepare()

    def new_cache(self, batch: int, capacity: int = 256) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: ModelCache,
        last_only: bool = False,
        exact_logits: bool = False,
    ) -> torch.Tensor:
        """tokens, positions [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), fp32.

        K/V of these tokens are written into `cache` at their positions; each query attends to
        every cached key at or before its own position. `exact_logits`: the lean CPU forward's
        int8 lm_head (engine.model.lean_cpu) gives way to the fp32 one, for a constrained
        choice that may pick far from the best logit.
        """
        if not self.small_on_cpu:
            return self._forward(tokens, positions, cache, last_only, exact_logits)
        with cpu_threads.intra_op_threads(cpu_threads.for_forward(tokens.numel())):
            return self._forward(tokens, positions, cache, last_only, exact_logits)

    def _forward(self, tokens, positions, cache: ModelCache, last_only, exact_logits):
        cfg = self.config
        batch, n_tokens = tokens.shape
        if batch == 1 and n_tokens <= LEAN_PROMPT_MAX_ROWS and self.lean is not None:
            # A decode step, or a prompt's few tokens (a cache hit's, a short cold prompt): the
            # lean forward reads each weight once for all rows, where the general path's
            # expert-by-expert products read every expert's fp32 copy.
            logits = self.lean.tail(
                tokens[0].tolist(),
                int(positions[0, 0]),
                cache,
                exact_logits,
                prompt=True,
                last_only=last_only,
            )
            if logits is not None:
                return logits[None]
        cache.reserve(int(positions.max()) + 1)
        x = F.embedding(tokens, self.embed)
        cos, sin = ref.rope_cos_sin(positions, self.inv_freq, self.dtype)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        for index, layer in enumerate(self.layers):
            x = decoder_layer(x, layer, index, positions, cos, sin, cache, cfg, self.options)
        if last_only:
            x = x[:, -1:]
            if batch == 1 and self.lean is not None:
                # The lean forward's lm_head reads a small model's head faster than F.linear's
                # one-row case does, the more so in int8.
                return self.lean.head(x[0], exact_logits)[None]
        x = ref.rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return linear(x, self.lm_head).float()

    @torch.inference_mode()
    def forward_tail(
        self, tokens: list[int], position: int, cache: ModelCache
    ) -> torch.Tensor | None:
        """Logits [n, V] of every one of one sequence's n new tokens at positions position..
        (the end of its cache), by the lean CPU forward; None where that forward does not apply
        (the caller then runs `forward`). Verifies a speculative draft: the weights are read once
        for all rows, so n rows cost far less than n decode steps."""
        if self.lean is None:
            return None
        with cpu_threads.intra_op_threads():
            return self.lean.tail(tokens, position, cache)

    @torch.inference_mode()
    def forward_beams(
        self,
        tokens: list[int],
        position: int,
        cache: ModelCache,
        tails: BeamKeys,
        exact_logits: bool = False,
    ) -> torch.Tensor | None:
        """Logits [B, V] of B beams' newest tokens, all at `position`, by the lean CPU forward:
        each beam sees the cache's positions 0..position-1 (the prompt, which every beam shares
        and none writes) and then its own tokens, whose K/V `tails`
        (engine.decoding.beam_search.BeamTails) holds and gains here. None where the lean forward
        does not apply: callers search only where `lean_path_applies()`, else they decode
        greedily. `exact_logits`: as for `forward`."""
        if self.lean is None:
            return None
        with cpu_threads.intra_op_threads():
            return self.lean.beams(tokens, position, cache, tails, exact_logits)


def weight_bytes(model: Qwen3MoeModel) -> int:
    """Bytes the model's weights hold (quantized ones as stored)."""
    weights = [model.embed, model.lm_head, model.final_norm]
    for layer in model.layers:
        weights += [w for w in vars(layer).values() if w is not None]
    unique = {id(w): w for w in weights}  # a tied lm_head is the embedding
    return sum(nbytes(w) for w in unique.values())
