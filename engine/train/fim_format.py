"""The special tokens and FIM layouts the default model is trained with.

PSM (prefix-suffix-middle), as Qwen2.5-Coder / Qwen3-Coder:
    <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>MIDDLE<|endoftext|>
SPM (suffix first, so typing at the cursor only appends to the prompt and the KV cache stays warm):
    <|fim_suffix|>SUFFIX<|fim_prefix|>PREFIX<|fim_middle|>MIDDLE<|endoftext|>
Plain left-to-right documents end with <|endoftext|>. Each piece is tokenized on its own, exactly
as an inference prompt is built from the editor's prefix and suffix.
"""

from __future__ import annotations

ENDOFTEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_PAD = "<|fim_pad|>"
FILE_SEP = "<|file_sep|>"
# Order fixes the ids 0..5 in the vocabulary.
SPECIAL_TOKENS = [ENDOFTEXT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, FILE_SEP]


def fim_prompt_ids(encode, token_id, prefix: str, suffix: str, order: str = "psm") -> list[int]:
    """Prompt ids for a FIM request; generation continues with the middle."""
    pre, suf, mid = token_id(FIM_PREFIX), token_id(FIM_SUFFIX), token_id(FIM_MIDDLE)
    if order == "psm":
        return [pre, *encode(prefix), suf, *encode(suffix), mid]
    if order == "spm":
        return [suf, *encode(suffix), pre, *encode(prefix), mid]
    raise ValueError(f"unknown FIM order {order!r}")
