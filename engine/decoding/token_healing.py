"""Token healing at the cursor.

A prefix cut at the cursor often ends in a token the model rarely saw there: byte-level BPE
writes an indented line as "\\n   " + " return", but a prefix that stops after the indentation
ends in "\\n    ", and one that stops mid-word ends in a word fragment. So the prompt leaves out
the end of the prefix (the cursor line's indentation, else its last token, or its last few while
they are whitespace alone), and decoding is
constrained until the model has written that text again (in whatever tokens it prefers); the
text is then dropped from the output, since the editor already has it.

    healer = token_healer(tokenizer)
    prefix_ids, forced = healer.split(prefix)       # prompt with prefix_ids; generate with
    forcing = Forcing(healer, forced)                # forcing.mask(logits) / forcing.advance(id)
"""

from __future__ import annotations

import functools

import torch

INDENT_BYTES = (b" ", b"\t")
MAX_BACKOFF = 4  # tokens a split may leave out after code


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable-character map (GPT-2's)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenHealer:
    """Per tokenizer: every token's bytes, and which tokens can start a given text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = tokenizer.backend
        special = set(backend.get_added_tokens_decoder())
        decoder = _byte_decoder()
        size = tokenizer.vocab_size
        self.token_bytes: list[bytes | None] = [None] * size
        for piece, i in backend.get_vocab(with_added_tokens=True).items():
            if i in special or i >= size:
                continue
            try:
                self.token_bytes[i] = bytes(decoder[c] for c in piece)
            except KeyError:  # not a byte-level vocabulary: no healing
                self.token_bytes = []
                break
        # Healing needs every single byte as a token, so any text can always be written.
        singles = {b for b in self.token_bytes if b is not None and len(b) == 1}
        self.supported = len(singles) == 256
        self._by_first_byte: dict[int, list[tuple[int, bytes]]] = {}
        for i, b in enumerate(self.token_bytes):
            if b:
                self._by_first_byte.setdefault(b[0], []).append((i, b))
        self._allowed_cache: dict[tuple[bytes, bool], torch.Tensor] = {}
        self._indent_starting: torch.Tensor | None = None
        # The last split ("" splits into nothing): a caller builds the prompt and then asks for
        # the forced text of the same prefix, which must not tokenize it twice.
        self._last_split: tuple[str, list[int], str] = ("", [], "")

    def split(self, prefix: str) -> tuple[list[int], str]:
        """The prompt's prefix ids and the text the model must write first:
        - the cursor line holds only indentation: the prefix up to the line's start, and the
          indentation (a FIM middle that starts a line starts with its indentation, as in
          training; on the held-out single-line tasks this beats backing off one token);
        - the cursor is at the start of a line (or of the file): nothing to heal, the prefix
          ends where a middle that starts a line begins in training;
        - else the prefix less its last token (and the ones before it while they are only
          whitespace, so whitespace alone is forced only as indentation), and their text;
        - all the ids and "" for a special token or part of a character."""
        last_prefix, ids, forced = (
            self._last_split
        )  # one tuple: safe across prompt-building threads
        if prefix == last_prefix:
            return list(ids), forced
        ids, forced = self._split(prefix)
        self._last_split = (prefix, ids, forced)
        return list(ids), forced

    def _split(self, prefix: str) -> tuple[list[int], str]:
        ids_of = self.tokenizer.encode
        line = prefix[prefix.rfind("\n") + 1 :]
        if not self.supported or not line:
            return ids_of(prefix), ""
        if not line.strip():
            return ids_of(prefix[: len(prefix) - len(line)]), line
        ids = ids_of(prefix)
        # Back off the last token, or more while they are all whitespace (a space typed after
        # code): only the indentation case forces whitespace alone, which Forcing relies on.
        for n in range(1, min(len(ids), MAX_BACKOFF) + 1):
            pieces = [self.token_bytes[i] if i < len(self.token_bytes) else None for i in ids[-n:]]
            if any(p is None for p in pieces):  # a special token: nothing to heal
                return ids, ""
            try:
                text = b"".join(pieces).decode("utf-8")
            except UnicodeDecodeError:
                return ids, ""
            if not prefix.endswith(text):
                return ids, ""
            if text.strip():
                return ids[:-n], text
        return ids, ""

    def allowed(self, remaining: bytes, deeper: bool = True) -> torch.Tensor:
        """Ids of the tokens that can come next while `remaining` must still be written: those
        that are a start of it, or that start with all of it (with `deeper` False, not followed
        by more indentation)."""
        key = (remaining, deeper)
        cached = self._allowed_cache.get(key)
        if cached is None:
            n = len(remaining)
            cached = torch.tensor(
                [
                    i
                    for i, b in self._by_first_byte.get(remaining[0], [])
                    if remaining.startswith(b)
                    or (b.startswith(remaining) and (deeper or b[n : n + 1] not in INDENT_BYTES))
                ],
                dtype=torch.long,
            )
            if len(self._allowed_cache) > 4096:
                self._allowed_cache.clear()
            self._allowed_cache[key] = cached
        return cached

    def indent_starting(self) -> torch.Tensor:
        """Ids of the tokens that start with a space or a tab."""
        if self._indent_starting is None:
            self._indent_starting = torch.tensor(
                [i for first in INDENT_BYTES for i, _ in self._by_first_byte.get(first[0], [])],
                dtype=torch.long,
            )
        return self._indent_starting


def token_healer(tokenizer) -> TokenHealer:
    """The tokenizer's healer, built once: it scans the whole vocabulary."""
    healer = getattr(tokenizer, "_token_healer", None)
    if healer is None:
        healer = TokenHealer(tokenizer)
        tokenizer._token_healer = healer
    return healer


def forcing_for(tokenizer, text: str) -> Forcing | None:
    """A request's constraint, or None when it has no text to write again."""
    return Forcing(token_healer(tokenizer), text) if text else None


class Forcing:
    """One request's constraint: the text its first tokens must write. When that text is the
    cursor line's indentation (whitespace alone: `TokenHealer.split` forces nothing else that is
    only whitespace), the completion also may not indent deeper than the user's cursor (a longer
    whitespace token, or whitespace right after it): the editor put the cursor there."""

    def __init__(self, healer: TokenHealer, text: str):
        self.healer = healer
        # A vocabulary that cannot write every text forces nothing (split never heals with it).
        self.remaining = text.encode() if healer.supported else b""
        self.indentation = bool(self.remaining) and not self.remaining.strip(b" \t")

    @property
    def active(self) -> bool:
        return bool(self.remaining) or self.indentation

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (last dim = vocabulary) with every token that would break the text at -inf."""
        if not self.remaining:  # the indentation is written: the next token may not add to it
            masked = logits.clone()
            masked[..., self.healer.indent_starting().to(logits.device)] = float("-inf")
            return masked
        allowed = self.healer.allowed(self.remaining, deeper=not self.indentation).to(logits.device)
        masked = torch.full_like(logits, float("-inf"))
        masked[..., allowed] = logits[..., allowed]
        return masked

    def advance(self, token_id: int) -> None:
        pieces = self.healer.token_bytes
        piece = (pieces[token_id] if token_id < len(pieces) else None) or b""
        if not self.remaining:
            self.indentation = False  # the token after the indentation is written: done
            return
        if piece and self.remaining.startswith(piece):
            self.remaining = self.remaining[len(piece) :]  # all of the indentation: one more step
        else:  # the token went on past the text (the mask let no whitespace through)
            self.remaining, self.indentation = b"", False
