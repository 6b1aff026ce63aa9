"""Where the engine daemon keeps its socket, lock and log. Imports no torch.

The socket lives in `$XDG_RUNTIME_DIR/wd-lsp/` (a per-user tmpfs on most desktops) or, when that
is unset, in a per-user directory under the system temp dir; either way the directory is
owner-only (0700) and the socket 0600. Logs go to `$XDG_STATE_HOME/wd-lsp/` (~/.local/state).
`WD_ENGINE_DIR` overrides the runtime directory (tests, several engines side by side).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


class UnsafeRuntimeDir(RuntimeError):
    """The runtime directory belongs to someone else or is open to others."""


def runtime_dir() -> Path:
    if os.environ.get("WD_ENGINE_DIR"):
        path = Path(os.environ["WD_ENGINE_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "wd-lsp"
    else:
        path = Path(tempfile.gettempdir()) / f"wd-lsp-{os.getuid()}"
    return ensure_private_dir(path)


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700, or check that an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UnsafeRuntimeDir(f"{path} is not a directory owned by this user")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_path() -> Path:
    return runtime_dir() / "engine.sock"


def lock_path() -> Path:
    return runtime_dir() / "engine.lock"


def log_path() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    directory = base / "wd-lsp"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / "engine.log"
