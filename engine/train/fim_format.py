"""The special tokens and FIM layouts the default model is trained with.

PSM (prefix-suffix-middle), as Qwen2.5-Coder / Qwen3-Coder:
    <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>MIDDLE<|endoftext|>
SPM (suffix first, so typing at the cursor only appends to the prompt and the KV cache stays warm):
    <|fim_suffix|>SUFFIX<|fim_prefix|>PREFIX<|fim_middle|>MIDDLE<|endoftext|>
Plain left-to-right documents end with <|endoftext|>. Each piece is tokenized on its own, exactly
as an inference prompt is built from the editor's prefix and suffix. The token names and the
layout are the engine's own (engine.prompts.fim).
"""

from __future__ import annotations

from engine.prompts.fim import (
    ENDOFTEXT,
    FILE_SEP,
    FIM_MIDDLE,
    FIM_PAD,
    FIM_PREFIX,
    FIM_SUFFIX,
    fim_layout,
)

# Order fixes the ids 0..5 in the vocabulary.
SPECIAL_TOKENS = [ENDOFTEXT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, FILE_SEP]


def fim_prompt_ids(encode, token_id, prefix: str, suffix: str, order: str = "psm") -> list[int]:
    """Prompt ids for a FIM request; generation continues with the middle."""
    ids = (token_id(FIM_PREFIX), token_id(FIM_SUFFIX), token_id(FIM_MIDDLE))
    return fim_layout(ids, encode(prefix), encode(suffix), order)
