"""Pack the built corpus into one xz archive to carry to the GPU machine (whose transfers are
size-limited), optionally keeping only a seeded fraction of the train files.

    python -m engine.train.pack --corpus .corpus --out .runs/pack/corpus.tar.xz [--fraction 0.55 --seed 2]

On the GPU machine: `mkdir -p .corpus && tar -xJf .runs/pack/corpus.tar.xz -C .corpus`.
"""
from __future__ import annotations

import argparse
import io
import random
import tarfile
from pathlib import Path


def subset_lines(lines: list[str], fraction: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [line for line in lines if rng.random() < fraction]


def pack(corpus: Path, out: Path, fraction: float = 1.0, seed: int = 2) -> None:
    train = (corpus / "train.jsonl").read_text().splitlines(keepends=True)
    if fraction < 1.0:
        train = subset_lines(train, fraction, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for name, data in (("train.jsonl", "".join(train).encode()),
                           ("heldout.jsonl", (corpus / "heldout.jsonl").read_bytes())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    print(f"{len(train)} train files -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args(argv)
    pack(args.corpus, args.out, args.fraction, args.seed)


if __name__ == "__main__":
    main()
