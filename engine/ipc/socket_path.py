"""The daemon's Unix socket on disk: checked before a model loads, bound owner-only, removed only
while it is still ours. Imports no torch, so `wd-engine serve` refuses a bad path at once.

Nothing here follows a symbolic link or unlinks anything but a socket of this user that nobody
listens on (a crashed engine's leftover).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from pathlib import Path

log = logging.getLogger("wd_engine")

LISTEN_BACKLOG = 128


class UnsafeSocketPath(RuntimeError):
    """Something other than a stale socket of ours is at the socket's path."""


class SocketInUse(RuntimeError):
    """An engine already listens on the socket's path."""


def file_kind(mode: int) -> str:
    """What a file other than a socket is, in words, for an error naming what is in the way."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
    ):
        if test(mode):
            return name
    return "a special file"


def prepare_socket_path(path: Path) -> None:
    """Refuse to start beside a live engine (SocketInUse), or over anything but a socket of ours
    (UnsafeSocketPath); remove a stale socket left by a crash. Never follows a symbolic link,
    never unlinks what is not a socket. (The default path's directory is checked by
    paths.runtime_dir, which gives it.)"""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafeSocketPath(
            f"{path} exists and is {file_kind(info.st_mode)}, not a socket; refusing to "
            "replace it: remove it or choose another --socket"
        )
    if info.st_uid != os.getuid():
        raise UnsafeSocketPath(f"the socket {path} belongs to another user; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno != errno.ECONNREFUSED:  # e.g. a full backlog: someone listens, busy
            raise UnsafeSocketPath(
                f"cannot tell whether an engine listens on {path}: {exc.strerror or exc}"
            ) from exc
        again = path.lstat()
        if (again.st_dev, again.st_ino) == (info.st_dev, info.st_ino):
            path.unlink()  # nobody listens: a crashed engine's leftover
            log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise SocketInUse(f"an engine is already listening on {path}")


def bind_socket(path: Path) -> tuple[socket.socket, tuple[int, int]]:
    """A Unix socket listening at `path`, after `prepare_socket_path`, and the (st_dev, st_ino)
    of its file, for `remove_own_socket`. It is 0600 from its first moment (the umask; no chmod,
    which would follow a link planted in its place). bind() never replaces anything that is
    there, and listen() follows at once: until then another engine starting would take the
    socket for a crashed one's leftover and replace it, and the identity, taken now, would be
    that engine's socket."""
    prepare_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is created 0600: no window where others can connect
    try:
        sock.bind(str(path))
        sock.listen(LISTEN_BACKLOG)
        info = path.lstat()
    except OSError as exc:
        sock.close()
        raise UnsafeSocketPath(f"cannot listen on {path}: {exc.strerror or exc}") from exc
    finally:
        os.umask(old_umask)
    return sock, (info.st_dev, info.st_ino)


def remove_own_socket(path: Path, identity: tuple[int, int]) -> None:
    """Unlink the socket only if it is still the one this daemon bound: while it drained, a
    successor may have replaced the path, and deleting that one would strand the new engine."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == identity:
        path.unlink(missing_ok=True)
