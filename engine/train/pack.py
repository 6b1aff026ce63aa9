"""Pack the built corpus into one xz archive to carry to the GPU machine (whose transfers are
size-limited), optionally keeping only a seeded fraction of the train files.

    python -m engine.train.pack --corpus .corpus --out .runs/pack/corpus.tar.xz [--fraction 0.55 --seed 2]

On the GPU machine: `mkdir -p .corpus && tar -xJf .runs/pack/corpus.tar.xz -C .corpus`.

With `--exclude-gpu-machine` the pack leaves out every train file that the GPU machine builds
itself: the standard library and the packages listed in `data/gpu_machine_packages.txt`
(its image's packages). It carries the rest (npm, packages only here) and the held-out files,
and the GPU machine then builds its own part, filtered against those held-out files:

    python -m engine.train.corpus --out .corpus --heldout-from .corpus/heldout.jsonl --no-npm \\
        --train-name train-gpu.jsonl --manifest-out .corpus/manifest-gpu.json \\
        --heldout-list-out .corpus/heldout-gpu.txt
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import random
import re
import tarfile
from pathlib import Path

GPU_MACHINE_PACKAGES = Path(__file__).parent / "data" / "gpu_machine_packages.txt"


def subset_lines(lines: list[str], fraction: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [line for line in lines if rng.random() < fraction]


def normalize(name: str) -> str:
    """PEP 503 project name: 'PyYAML' -> 'pyyaml', 'typing_extensions' -> 'typing-extensions'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_package_list(path: Path = GPU_MACHINE_PACKAGES) -> set[str]:
    return {normalize(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def built_there(doc_id: str, packages: set[str]) -> bool:
    """Does a machine with these packages build this doc itself (its stdlib, or a listed package)?"""
    kind, _, rest = doc_id.partition(":")
    return kind == "python-stdlib" or (kind == "pypi" and normalize(rest.partition(":")[0]) in packages)


def pack(corpus: Path, out: Path, fraction: float = 1.0, seed: int = 2,
         exclude: set[str] | None = None) -> None:
    train = (corpus / "train.jsonl").read_text().splitlines(keepends=True)
    full_files, full_bytes = len(train), sum(map(len, train))
    if exclude is not None:
        train = [line for line in train if not built_there(json.loads(line)["id"], exclude)]
    if fraction < 1.0:
        train = subset_lines(train, fraction, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The strongest preset: the pack is made once and its size is what the transfer limit bounds.
    with tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for name, data in (("train.jsonl", "".join(train).encode()),
                           ("heldout.jsonl", (corpus / "heldout.jsonl").read_bytes())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    print(f"{len(train)} of {full_files} train files ({sum(map(len, train)) / 1e6:.1f} of "
          f"{full_bytes / 1e6:.1f} MB of jsonl) -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--exclude-gpu-machine", action="store_true",
                    help="leave out the train files the GPU machine builds itself (stdlib, its packages)")
    ap.add_argument("--package-list", type=Path, default=GPU_MACHINE_PACKAGES,
                    help="that machine's packages, one name a line (with --exclude-gpu-machine)")
    args = ap.parse_args(argv)
    exclude = read_package_list(args.package_list) if args.exclude_gpu_machine else None
    pack(args.corpus, args.out, args.fraction, args.seed, exclude)


if __name__ == "__main__":
    main()
