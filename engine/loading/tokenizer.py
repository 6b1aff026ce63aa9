"""The model's tokenizer (`tokenizer.json` through `tokenizers`) and UTF-8-safe streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from engine.model.config import ModelFormatError

REPLACEMENT_CHAR = "\ufffd"

# Control tokens are never released as completion text. Those that close a middle or a file end
# the completion as EOS does; those that open a prompt section are never sampled (a small model
# sometimes announces the middle again and then writes the right line).
ENDING_TOKENS = ("<|endoftext|>", "<|fim_suffix|>", "<|fim_pad|>", "<|file_sep|>")
UNSAMPLED_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>")


class Tokenizer:
    def __init__(self, backend: _HFTokenizer, eos_ids: tuple[int, ...] = (), prompt_backend=None):
        # Two encoders. `encode` reads "<|endoftext|>" typed in a user's file as text, not as a
        # control token: in completion prompts special tokens enter only by id
        # (engine.prompts.fim), so file contents can't steer the model. `encode_prompt` keeps
        # them, for raw prompts whose author writes the special tokens on purpose (CLI --prompt,
        # OpenAI-style clients).
        self.prompt_backend = prompt_backend or backend
        backend.encode_special_tokens = True
        self.backend = backend
        self.eos_ids = eos_ids
        self.unsampled_ids = self._present(UNSAMPLED_TOKENS)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(f"no tokenizer.json in {model_dir}")
        tokenizer = cls(
            _HFTokenizer.from_file(str(path)), prompt_backend=_HFTokenizer.from_file(str(path))
        )
        eos = list(extra_eos_ids)
        eos += _eos_from_json(model_dir / "generation_config.json", "eos_token_id")
        eos += tokenizer._present(ENDING_TOKENS)
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            name = json.loads(cfg_path.read_text()).get("eos_token")
            if isinstance(name, dict):  # older configs store an AddedToken dict
                name = name.get("content")
            if name and tokenizer.token_id(name) is not None:
                eos.append(tokenizer.token_id(name))
        tokenizer.eos_ids = tuple(dict.fromkeys(eos))  # de-duplicated, order kept
        return tokenizer

    def _present(self, names: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(i for i in map(self.backend.token_to_id, names) if i is not None)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        return self.prompt_backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Byte-level BPE tokens can end mid-character; such text decodes with a trailing U+FFFD,
    so a delta is held back until the character completes. A short window of earlier tokens
    is re-decoded with the new ones so that merges across token boundaries come out right.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the re-decoded window
        self.read_offset = 0  # tokens before this are already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        emitted = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(emitted) and not full.endswith(REPLACEMENT_CHAR):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end. A character cut off by the end of generation is
        dropped rather than shown as U+FFFD."""
        decode = self.tokenizer.decode
        emitted = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(emitted) :].rstrip(REPLACEMENT_CHAR)


def _eos_from_json(path: Path, key: str) -> list[int]:
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get(key)
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]
