"""Train the byte-level BPE tokenizer on the train split and save it in Hugging Face format.

    python -m engine.train.tokenizer_build --corpus .corpus --out engine/models/wd-coder-tiny

No normalizer and a ByteLevel pre-tokenizer/decoder without prefix space, so decode(encode(s)) == s
for every string. Special tokens take ids 0..5 (see fim_format.SPECIAL_TOKENS).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .fim_format import ENDOFTEXT, FIM_PAD, SPECIAL_TOKENS

VOCAB_SIZE = 16000
SAMPLE_BYTES = 48_000_000
SEED = 1234


def sample_texts(corpus: Path, budget: int, seed: int = SEED):
    """A seeded sample of train documents, about `budget` bytes, in a fixed order."""
    lines = (corpus / "train.jsonl").read_text().splitlines()
    random.Random(seed).shuffle(lines)
    used = 0
    for line in lines:
        text = json.loads(line)["text"]
        used += len(text)
        yield text
        if used >= budget:
            break


def build_tokenizer(texts, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "add_bos_token": False,
        "eos_token": ENDOFTEXT,
        "pad_token": FIM_PAD,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }


def save(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    tok = build_tokenizer(sample_texts(args.corpus, SAMPLE_BYTES), args.vocab_size)
    save(tok, args.out)
    print(f"vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
