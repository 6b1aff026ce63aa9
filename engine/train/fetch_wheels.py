"""Fetch the wheels of a package list and unpack their Python files and metadata into one folder,
which the corpus builder reads with `--site` (nothing is installed, no dependencies are fetched,
no code runs).

    python -m engine.train.fetch_wheels --list engine/train/data/extra_packages.txt \\
        --out .corpus/extra

writes the wheels to OUT/wheels and unpacks each listed one into its own folder under OUT/site (so
two wheels that ship the same path, say `tests/conftest.py`, cannot overwrite each other's file
under the other's licence). The corpus part they make:

    python -m engine.train.corpus --out .corpus --site .corpus/extra/site \\
        --heldout-from .corpus/heldout.jsonl --train-name train-extra.jsonl \\
        --manifest-out engine/train/data/manifest-extra.json \\
        --heldout-list-out engine/train/data/heldout-extra.txt \\
        --exclude-from engine/train/data/manifest.json \\
        --exclude-from engine/train/data/manifest-gpu.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .corpus import normalize


def read_list(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def download(requirement: str, dest: Path) -> str | None:
    """pip download one wheel (no dependencies, no sdist builds); the error text if it failed."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        requirement,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    errors = [l for l in done.stderr.splitlines() if l.strip() and not l.startswith("[notice]")]
    return None if done.returncode == 0 else (errors or ["failed"])[-1]


def wheel_key(filename: str) -> str:
    """'Django-5.2.19-py3-none-any.whl' -> 'django==5.2.19' (the wheel file name's escaped form)."""
    name, version = filename.split("-")[:2]
    return f"{normalize(name)}=={version}"


def requirement_key(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    return f"{normalize(name.strip())}=={version.strip()}"


def unpack(wheel: Path, site: Path) -> int:
    """Extract the wheel's .py files and its .dist-info folder (metadata, RECORD, licence);
    returns the number of files written."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            top = name.split("/", 1)[0]
            if name.endswith(".py") or top.endswith(".dist-info"):
                z.extract(name, site)  # zipfile drops absolute paths and '..' parts
                n += 1
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--list", type=Path, required=True, help="one requirement (name==version) a line"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument(
        "--allow-missing", action="store_true", help="go on when a wheel cannot be fetched"
    )
    args = ap.parse_args(argv)
    wheels, site = args.out / "wheels", args.out / "site"
    wheels.mkdir(parents=True, exist_ok=True)
    requirements = read_list(args.list)
    with ThreadPoolExecutor(args.jobs) as pool:
        errors = list(pool.map(lambda r: download(r, wheels), requirements))
    failed = [(r, e) for r, e in zip(requirements, errors) if e]
    for r, e in failed:
        print(f"not fetched: {r}: {e}", file=sys.stderr)
    if failed and not args.allow_missing:
        raise SystemExit(
            f"{len(failed)} wheels not fetched (--allow-missing to go on without them)"
        )
    # Only the listed wheels: the folder may hold others from an earlier, different list.
    wanted = {requirement_key(r) for r in requirements}
    listed = [w for w in sorted(wheels.glob("*.whl")) if wheel_key(w.name) in wanted]
    shutil.rmtree(site, ignore_errors=True)
    files = sum(unpack(w, site / w.name.removesuffix(".whl")) for w in listed)
    print(f"{len(listed)} of {len(requirements)} wheels unpacked; {files} files in {site}")


if __name__ == "__main__":
    main()
