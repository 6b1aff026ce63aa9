"""Training examples: documents -> chunks -> FIM (PSM / SPM) or left-to-right -> packed token rows.

Each worker of the DataLoader walks its own seeded shuffle of chunks and yields [rows, seq_len + 1]
int64 tensors (inputs and shifted targets share one row); a FIM example never straddles two rows.
FIM spans are chosen at the character level, half of them aligned to whole lines (as an editor
completes a line or a block), and each piece is tokenized on its own, exactly as inference
prompts are.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .fim_format import ENDOFTEXT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

CHUNK_CHARS = 3000  # about 800 tokens, so one FIM example fits in one 1024-token row
# SPM is the order the server prompts with (suffix first keeps the prefix cache warm), so it gets
# the larger share; PSM stays in the mix for PSM-only clients. The rest (0.3) is left-to-right.
P_PSM, P_SPM = 0.25, 0.45
P_LINE_ALIGNED = 0.6  # an editor mostly completes at a line's indentation: a line or a block
P_INDENT_IN_PREFIX = 0.75


def load_tokenizer(path: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = (
        True  # "<|endoftext|>" inside a source file is text, not a control token
    )
    return tok


def read_docs(jsonl: Path) -> list[str]:
    with open(jsonl) as f:
        return [json.loads(line)["text"] for line in f]


def chunk_doc(text: str, limit: int = CHUNK_CHARS) -> list[str]:
    """Split at line boundaries into pieces of at most ~limit chars (a longer single line stays
    whole)."""
    chunks, cur, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if size + len(line) > limit and cur:
            chunks.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        chunks.append("".join(cur))
    return chunks


def fim_split(text: str, rng: random.Random) -> tuple[str, str, str]:
    """Pick (prefix, middle, suffix). Line-aligned: 1..8 whole lines, without the last newline."""
    if rng.random() < P_LINE_ALIGNED:
        starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
        a = rng.randrange(len(starts))
        n_lines = min(len(starts) - a, 1 if rng.random() < 0.5 else rng.randint(2, 8))
        start = starts[a]
        end = starts[a + n_lines] - 1 if a + n_lines < len(starts) else len(text.rstrip("\n"))
        if rng.random() < P_INDENT_IN_PREFIX:  # the cursor usually sits after the indentation
            start += len(text[start:end]) - len(text[start:end].lstrip(" \t"))
        end = max(start, end)
        return text[:start], text[start:end], text[end:]
    i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    return text[:i], text[i:j], text[j:]


class ExampleEncoder:
    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.eos, self.pre, self.mid, self.suf = (
            tok.token_to_id(t) for t in (ENDOFTEXT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX)
        )

    def enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids if s else []

    def encode(self, text: str, rng: random.Random) -> tuple[list[int], bool]:
        """(token ids, is_fim) for one chunk."""
        r = rng.random()
        if r >= P_PSM + P_SPM or len(text) < 2:
            return self.enc(text) + [self.eos], False
        prefix, middle, suffix = fim_split(text, rng)
        if r < P_PSM:
            head = [self.pre, *self.enc(prefix), self.suf, *self.enc(suffix), self.mid]
        else:
            head = [self.suf, *self.enc(suffix), self.pre, *self.enc(prefix), self.mid]
        return head + self.enc(middle) + [self.eos], True


class RowPacker:
    """Packs examples into rows of `width` tokens so that no FIM example straddles two rows
    (a cut one would teach a middle without its prefix); left-to-right text, which can be cut
    anywhere, fills the space a FIM example leaves at the end of a row."""

    def __init__(self, width: int, pad_id: int):
        self.width, self.pad_id = width, pad_id
        self.row: list[int] = []
        self.plain: list[int] = []

    def add(self, ids: list[int], is_fim: bool):
        """Add one example; yields every row it completes."""
        if not is_fim:
            self.plain.extend(ids)
            while len(self.plain) >= 2 * self.width:  # plenty of filler: ship some as plain rows
                yield self.plain[: self.width]
                self.plain = self.plain[self.width :]
            return
        if len(ids) > self.width:
            ids = ids[: self.width]  # rare with CHUNK_CHARS; the middle's tail is what gets lost
        if len(self.row) + len(ids) > self.width:
            yield self._top_up()
        self.row.extend(ids)

    def _top_up(self) -> list[int]:
        need = self.width - len(self.row)
        fill, self.plain = self.plain[:need], self.plain[need:]
        row = self.row + fill + [self.pad_id] * (need - len(fill))
        self.row = []
        return row


class PackedStream(torch.utils.data.IterableDataset):
    """Endless stream of packed rows; each DataLoader worker takes every n-th chunk of its
    shuffle."""

    def __init__(self, chunks: list[str], tokenizer_path: Path, seq_len: int, rows: int, seed: int):
        self.chunks, self.tokenizer_path = chunks, tokenizer_path
        self.seq_len, self.rows, self.seed = seq_len, rows, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        encoder = ExampleEncoder(load_tokenizer(self.tokenizer_path))
        packer = RowPacker(self.seq_len + 1, encoder.eos)
        rng = random.Random(self.seed * 1000 + wid)
        batch: list[list[int]] = []
        epoch = 0
        while True:
            order = list(range(len(self.chunks)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            for idx in order[wid::nw]:
                for row in packer.add(*encoder.encode(self.chunks[idx], rng)):
                    batch.append(row)
                    if len(batch) == self.rows:
                        yield torch.tensor(batch, dtype=torch.int64)
                        batch = []
            epoch += 1


def heldout_rows(docs: list[str], tok: Tokenizer, seq_len: int, max_rows: int):
    """Left-to-right held-out rows and the byte count of every target (for loss and bits per
    byte)."""
    eos = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for d in docs:
        ids.extend(tok.encode(d, add_special_tokens=False).ids + [eos])
        if len(ids) >= max_rows * (seq_len + 1):
            break
    n = min(max_rows, len(ids) // (seq_len + 1))
    rows = torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.int64).view(n, seq_len + 1)
    return rows, token_byte_lengths(tok)[rows[:, 1:]]


def heldout_fim_rows(
    docs: list[str],
    tok: Tokenizer,
    seq_len: int,
    max_rows: int,
    seed: int = 0,
    healed: bool = False,
):
    """Single-line SPM examples cut from held-out files as the eval cuts them (fim_tasks), one per
    padded row, and the mask of the targets that are the middle and its end: the loss there tracks
    what completions need, which the left-to-right loss can miss. `healed`: the cursor line's
    indentation moves from the prefix to the middle, as the engine's token healing prompts."""
    from .fim_tasks import (
        make_task,
    )  # the eval's cut: a random non-empty line, indentation in the prefix

    eos, pad = tok.token_to_id(ENDOFTEXT), tok.token_to_id("<|fim_pad|>")
    pre, mid, suf = (tok.token_to_id(t) for t in (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids if text else []

    rows, masks = [], []
    for i, doc in enumerate(docs):
        task = make_task(str(i), doc, "single", random.Random(f"{seed}:heldout-fim:{i}"))
        if task is None:
            continue
        prefix, middle = task.prefix, task.middle
        indent = prefix[prefix.rfind("\n") + 1 :]
        if healed and indent and not indent.strip():
            prefix, middle = prefix[: len(prefix) - len(indent)], indent + middle
        head = [suf, *enc(task.suffix), pre, *enc(prefix), mid]
        ids = head + enc(middle) + [eos]
        if len(ids) > seq_len + 1:
            continue
        targets = torch.zeros(seq_len, dtype=torch.bool)
        targets[len(head) - 1 : len(ids) - 1] = (
            True  # predictions of the middle's tokens and of its end
        )
        rows.append(ids + [pad] * (seq_len + 1 - len(ids)))
        masks.append(targets)
        if len(rows) == max_rows:
            break
    return torch.tensor(rows, dtype=torch.int64).view(-1, seq_len + 1), torch.stack(
        masks
    ) if masks else torch.zeros(0, seq_len, dtype=torch.bool)


def token_byte_lengths(tok: Tokenizer) -> torch.Tensor:
    """Bytes each id stands for: one ByteLevel character is one byte; special tokens count 0."""
    lengths = torch.zeros(tok.get_vocab_size(), dtype=torch.int64)
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    for token, i in tok.get_vocab().items():
        lengths[i] = 0 if token in specials else len(token)
    return lengths
