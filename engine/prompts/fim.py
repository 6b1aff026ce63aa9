"""Fill-in-the-middle prompt layout, from the model's own FIM special tokens: their names, defined
here once (the trainer's tokenizer takes them from here too), and the two orders.

Two orders:
- PSM: <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>   (Qwen2.5/3-Coder's format)
- SPM: <|fim_suffix|>suffix<|fim_prefix|>prefix<|fim_middle|>   (suffix first, so typing at the
  cursor only appends to the prompt and the prefix cache stays warm)
The model generates the middle after <|fim_middle|>.
"""

from __future__ import annotations

from engine.decoding.token_healing import token_healer

ENDOFTEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_PAD = "<|fim_pad|>"
FILE_SEP = "<|file_sep|>"

ORDERS = ("psm", "spm")


class FimUnsupported(ValueError):
    """The model's tokenizer has no FIM special tokens."""


def fim_token_ids(tokenizer) -> tuple[int, int, int]:
    ids = [tokenizer.token_id(name) for name in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)]
    if any(i is None for i in ids):
        raise FimUnsupported(
            f"this model's tokenizer has no FIM tokens ({FIM_PREFIX}, {FIM_SUFFIX}, {FIM_MIDDLE})"
        )
    return ids[0], ids[1], ids[2]


def fim_layout(
    ids: tuple[int, int, int], prefix_ids: list[int], suffix_ids: list[int], order: str = "psm"
) -> list[int]:
    """The FIM body in `order` from the (prefix, suffix, middle) marker ids and the pieces' ids."""
    pre, suf, mid = ids
    if order == "psm":
        return [pre, *prefix_ids, suf, *suffix_ids, mid]
    if order == "spm":
        return [suf, *suffix_ids, pre, *prefix_ids, mid]
    raise ValueError(f"unknown FIM order {order!r}; expected one of {ORDERS}")


def build_fim_prompt(
    tokenizer, prefix: str, suffix: str, order: str = "psm", heal: bool = False
) -> list[int]:
    """Token ids of a FIM prompt; the completion is what the model writes next. With `heal`, the
    end of the prefix is left out (the cursor line's indentation, else its last token or trailing
    whitespace tokens; see
    engine.decoding.token_healing): generate with `forced_text=healed_text(tokenizer, prefix)`."""
    if order not in ORDERS:
        raise ValueError(f"unknown FIM order {order!r}; expected one of {ORDERS}")
    ids = fim_token_ids(tokenizer)
    prefix_ids = token_healer(tokenizer).split(prefix)[0] if heal else tokenizer.encode(prefix)
    return fim_layout(ids, prefix_ids, tokenizer.encode(suffix), order)


def healed_text(tokenizer, prefix: str) -> str:
    """The end of the prefix that a healed prompt leaves for the model to write again."""
    return token_healer(tokenizer).split(prefix)[1]
