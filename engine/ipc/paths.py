"""Where the engine daemon keeps its socket and log. Imports no torch.

The socket lives in `$XDG_RUNTIME_DIR/wd-lsp/` (a per-user tmpfs on most desktops) or, when that
is unset, in a per-user directory under the system temp dir; either way the directory is
owner-only (0700) and the socket 0600. Logs go to `$XDG_STATE_HOME/wd-lsp/` (~/.local/state),
also 0700, each log 0600 and never written through a symbolic link.
`WD_ENGINE_DIR` overrides the runtime directory (tests, several engines side by side).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import IO


class UnsafeRuntimeDir(RuntimeError):
    """The runtime directory belongs to someone else or is open to others."""


class UnsafeLogFile(RuntimeError):
    """Something other than our own regular file is at a log's path."""


def runtime_dir() -> Path:
    if os.environ.get("WD_ENGINE_DIR"):
        path = Path(os.environ["WD_ENGINE_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "wd-lsp"
    else:
        path = Path(tempfile.gettempdir()) / f"wd-lsp-{os.getuid()}"
    return ensure_private_dir(path)


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700, or check that an existing one is ours and private. A symbolic link
    there is refused, even one to a directory of ours. The directory is checked and its mode fixed
    through one descriptor (O_NOFOLLOW): a link swapped in meanwhile is never followed."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass  # checked below, whatever it is
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # a link (ELOOP), not a directory (ENOTDIR), gone
        raise UnsafeRuntimeDir(
            f"{path} is not a directory owned by this user ({exc.strerror})"
        ) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise UnsafeRuntimeDir(f"{path} is not a directory owned by this user")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def socket_path() -> Path:
    return runtime_dir() / "engine.sock"


def log_dir() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return ensure_private_dir(base / "wd-lsp")


def log_path() -> Path:
    return log_dir() / "engine.log"


def open_private_log(path: Path, mode: str = "ab") -> IO:
    """Open the log at `path` for appending ("ab" binary, "a" text), creating it 0600.

    Never follows a symbolic link planted at `path` (O_NOFOLLOW), never blocks on a FIFO there
    (O_NONBLOCK: no effect on a regular file), refuses anything but a regular file of ours, and
    takes a log left group- or world-readable by an older version back to 0600.
    """
    if mode not in ("ab", "a"):
        raise ValueError(f"a log is opened for appending ('ab' or 'a'), not {mode!r}")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafeLogFile(
                f"refusing to write the log through the symbolic link at {path}"
            ) from exc
        raise UnsafeLogFile(f"cannot open the log {path}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise UnsafeLogFile(
                f"{path} is not a regular file owned by this user; not logging there"
            )
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)  # the daemon inherits it as stdout/stderr
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        raise
