"""Which editor integrations of wd-lsp are set up for this user (`wd-engine doctor`): the VS Code
extension's folder, Neovim and a config that loads the plugin, and the Helix, Zed and Emacs
configs that name the server (editors/README.md has each one's set-up). Looked for in the home
and XDG config folders only; nothing is run but `nvim --version`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from engine.models import short_path

EXTENSION_PREFIX = "wd-lsp.wd-lsp-"  # publisher.name-version, as VS Code unpacks it
# Where VS Code and its relatives keep extensions, under the home folder.
_EXTENSION_DIRS = (
    ".vscode/extensions",
    ".vscode-server/extensions",
    ".vscode-oss/extensions",
    ".local/share/code-server/extensions",
    ".cursor/extensions",
)
_MAX_CONFIG_FILES = 500  # a Neovim config is searched this far for the plugin's name


def _config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def find_editor_setups() -> list[str]:
    """One line per integration found, with where it was found."""
    found = []
    home = Path.home()
    for rel in _EXTENSION_DIRS:
        folder = home / rel
        try:
            names = sorted(p.name for p in folder.iterdir() if p.name.startswith(EXTENSION_PREFIX))
        except OSError:
            continue
        for name in names:
            version = name.removeprefix(EXTENSION_PREFIX)
            found.append(f"VS Code extension {version} in {short_path(folder / name)}")
    nvim = _neovim()
    if nvim:
        found.append(nvim)
    for editor, file in (
        ("Helix", _config_home() / "helix" / "languages.toml"),
        ("Zed", _config_home() / "zed" / "settings.json"),
    ):
        if _mentions(file, "wd-lsp"):
            found.append(f"{editor}: wd-lsp in {short_path(file)}")
    for file in (
        home / ".emacs",
        home / ".emacs.el",
        home / ".emacs.d" / "init.el",
        _config_home() / "emacs" / "init.el",
    ):
        if _mentions(file, "wd-lsp"):
            found.append(f"Emacs: wd-lsp in {short_path(file)}")
            break
    return found


def _neovim() -> str | None:
    """Neovim's version, and the config file that sets up the plugin (`wd_lsp`)."""
    config = _config_home() / "nvim"
    setup = next(
        (f for f in _config_files(config) if _mentions(f, "wd_lsp")),
        None,
    )
    binary = shutil.which("nvim")
    if binary is None and setup is None:
        return None
    version = "not on PATH"
    if binary:
        try:
            out = subprocess.run(
                [binary, "--version"], capture_output=True, text=True, timeout=5, check=False
            ).stdout
            version = (out.splitlines() or ["?"])[0].removeprefix("NVIM ").strip()
        except (OSError, subprocess.TimeoutExpired):
            version = "did not answer --version"
    plugin = (
        f"the plugin set up in {short_path(setup)}"
        if setup
        else "the plugin not set up (editors/README.md)"
    )
    return f"Neovim {version}, {plugin}"


def _config_files(folder: Path):
    count = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.endswith((".lua", ".vim")):
                count += 1
                if count > _MAX_CONFIG_FILES:
                    return
                yield Path(root) / name


def _mentions(path: Path, word: str) -> bool:
    try:
        return path.is_file() and path.stat().st_size < (1 << 20) and word in path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
