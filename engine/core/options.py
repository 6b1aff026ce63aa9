"""How an engine is built: the one set of choices `Engine(model, tokenizer, options)` takes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# One chunk holds a whole 4K prompt: 1.2-1.3x the tokens a second of 2,048-token chunks in every
# weight format, and the capped 30B-A3B fits keep their KV pools (BENCHMARKS.md, "Prefill in one
# 4,096-token chunk").
CUDA_PREFILL_CHUNK = 4096
CPU_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class EngineOptions:
    # The KV pool: this many blocks, else as many as `kv_memory_bytes` holds.
    num_blocks: int | None = None
    block_size: int = 16  # tokens per KV block
    kv_fp8: bool = False  # store K/V in fp8 (e4m3) with scales
    kv_memory_bytes: int = 256 << 20
    # Prompt tokens per step: bounds how long a cold prompt stalls running decodes. None:
    # CUDA_PREFILL_CHUNK on CUDA, where larger chunks run far faster per token, 512 on the CPU.
    prefill_chunk: int | None = None
    max_batch: int = 32  # sequences in one decode step
    # Blocks one owner may hold while another owner is served: with a quarter, three clients that
    # queue all they can still leave room for a fourth.
    owner_block_share: float = 0.25
    salt: str = ""  # keys the prefix cache to the model (blocks of another model never match)
    prefix_cache: bool = True  # off: every prompt is computed cold (for comparisons)
    cuda_graphs: bool = True  # CUDA: decode steps and short prompt tails replay captured graphs
    speculative: bool = True  # prompt-lookup drafts for a lone greedy sequence on the CPU

    def __post_init__(self):
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {self.prefill_chunk}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1 token, got {self.block_size}")

    @classmethod
    def holding(cls, tokens: int, **choices) -> EngineOptions:
        """A pool of just enough blocks for `tokens` tokens: requests one at a time (the eval),
        where a larger pool would only cost memory."""
        options = cls(**choices)
        return replace(options, num_blocks=max(1, -(-tokens // options.block_size)))

    def chunk_for(self, device: torch.device) -> int:
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return CUDA_PREFILL_CHUNK if device.type == "cuda" else CPU_PREFILL_CHUNK
