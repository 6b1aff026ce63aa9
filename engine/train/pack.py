"""Pack the built corpus into one xz archive to carry to the GPU machine (whose transfers are
size-limited), optionally keeping only a seeded fraction of the train files.

    python -m engine.train.pack --corpus .corpus --out .runs/pack/corpus.tar.xz \\
        [--fraction 0.55 --seed 2]

On the GPU machine: `mkdir -p .corpus && tar -xJf .runs/pack/corpus.tar.xz -C .corpus`.

With `--exclude-gpu-machine` the pack leaves out every train file that the GPU machine builds
itself: the standard library and the packages listed in `data/gpu_machine_packages.txt`
(its image's packages). It carries the rest (npm, packages only here) and the held-out files,
and the GPU machine then builds its own part, filtered against those held-out files:

    python -m engine.train.corpus --out .corpus --heldout-from .corpus/heldout.jsonl --no-npm \\
        --train-name train-gpu.jsonl --manifest-out .corpus/manifest-gpu.json \\
        --heldout-list-out .corpus/heldout-gpu.txt

A train file too big for one transfer is split over several archives, in order, each holding
TRAIN-K.jsonl (a name the trainer reads), for `gpu_session.sh stage` to unpack call by call:

    python -m engine.train.pack --train-name train-extra.jsonl --parts 3 --no-heldout \\
        --out .runs/extra/extra.tar.xz          # extra.part1.tar.xz ... extra.part3.tar.xz
"""

from __future__ import annotations

import argparse
import bisect
import io
import itertools
import json
import lzma
import random
import tarfile
from pathlib import Path

from .corpus import normalize, read_package_names

GPU_MACHINE_PACKAGES = Path(__file__).parent / "data" / "gpu_machine_packages.txt"


def subset_lines(lines: list[str], fraction: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [line for line in lines if rng.random() < fraction]


def read_package_list(path: Path = GPU_MACHINE_PACKAGES) -> set[str]:
    return read_package_names(path)


def built_there(doc_id: str, packages: set[str]) -> bool:
    """Does a machine with these packages build this doc itself (its stdlib or a listed
    package)?"""
    kind, _, rest = doc_id.partition(":")
    return kind == "python-stdlib" or (
        kind == "pypi" and normalize(rest.partition(":")[0]) in packages
    )


def split_bytes(lines: list[str], parts: int) -> list[list[str]]:
    """Cut the lines into `parts` runs of about equal size, in order (neighbouring files of one
    package stay together, which compresses better); no run is empty, so there are at most as
    many runs as lines."""
    parts = max(1, min(parts, len(lines)))
    cumulative = list(itertools.accumulate(map(len, lines)))
    bounds = [0]
    for k in range(1, parts):
        cut = bisect.bisect_left(cumulative, cumulative[-1] * k / parts) + 1
        bounds.append(min(max(cut, bounds[-1] + 1), len(lines) - (parts - k)))
    bounds.append(len(lines))
    return [lines[a:b] for a, b in zip(bounds, bounds[1:])]


def write_archive(out: Path, members: list[tuple[str, bytes]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # The strongest preset: the pack is made once and its size is what the transfer limit bounds.
    with tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def pack(
    corpus: Path,
    out: Path,
    fraction: float = 1.0,
    seed: int = 2,
    exclude: set[str] | None = None,
    train_name: str = "train.jsonl",
    parts: int = 1,
    heldout: bool = True,
) -> list[Path]:
    """Write the archive(s); with parts > 1, OUT.partK.tar.xz holding TRAIN-K.jsonl each
    (every transfer has its own size limit, so a big corpus part goes over several)."""
    train = (corpus / train_name).read_text().splitlines(keepends=True)
    full_files, full_bytes = len(train), sum(map(len, train))
    if exclude is not None:
        train = [line for line in train if not built_there(json.loads(line)["id"], exclude)]
    if fraction < 1.0:
        train = subset_lines(train, fraction, seed)
    print(
        f"{len(train)} of {full_files} train files ({sum(map(len, train)) / 1e6:.1f} of "
        f"{full_bytes / 1e6:.1f} MB of jsonl)"
    )
    stem = train_name.removesuffix(".jsonl")
    written = []
    for k, lines in enumerate(split_bytes(train, parts), 1):
        path = (
            out
            if parts == 1
            else out.with_name(out.name.replace(".tar.xz", "") + f".part{k}.tar.xz")
        )
        members = [(train_name if parts == 1 else f"{stem}-{k}.jsonl", "".join(lines).encode())]
        if heldout and k == 1:
            members.append(("heldout.jsonl", (corpus / "heldout.jsonl").read_bytes()))
        write_archive(path, members)
        print(f"  {len(lines)} files -> {path} ({path.stat().st_size / 1e6:.1f} MB)")
        written.append(path)
    return written


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument(
        "--exclude-gpu-machine",
        action="store_true",
        help="leave out the train files the GPU machine builds itself (stdlib, its packages)",
    )
    ap.add_argument(
        "--package-list",
        type=Path,
        default=GPU_MACHINE_PACKAGES,
        help="that machine's packages, one name a line (with --exclude-gpu-machine)",
    )
    ap.add_argument(
        "--train-name", default="train.jsonl", help="the train file in --corpus to pack"
    )
    ap.add_argument(
        "--parts",
        type=positive_int,
        default=1,
        help="split the train file over this many archives (fewer if it has fewer files)",
    )
    ap.add_argument(
        "--no-heldout",
        action="store_true",
        help="leave the official held-out file out (another archive carries it)",
    )
    args = ap.parse_args(argv)
    if not args.train_name.startswith("train"):
        ap.error("--train-name must start with 'train' (the trainer reads train*.jsonl)")
    exclude = read_package_list(args.package_list) if args.exclude_gpu_machine else None
    pack(
        args.corpus,
        args.out,
        args.fraction,
        args.seed,
        exclude,
        args.train_name,
        args.parts,
        not args.no_heldout,
    )


if __name__ == "__main__":
    main()
