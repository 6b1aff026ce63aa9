"""Token files of the engine's TCP and HTTP listeners. Imports no torch.

A token the daemon makes is kept owner-only in the private runtime directory and reused by later
daemons; a token file the user names must be readable by its owner alone. Nothing here follows a
symbolic link planted at a path it writes, or writes into a file it did not create.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

TOKEN_MAX_BYTES = 4096


class TokenFileError(RuntimeError):
    """A token file that is unsafe or unfit to use; the message names its path."""


def read_token_file(path: Path) -> str:
    """The token in a file the user named. Refused, as ssh refuses a private key, when group or
    others have any access to it: on a shared machine they could use or replace the token. Links
    are followed (the path is the user's choice); pipes work (`--token-file <(pass show x)`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            raise TokenFileError(
                f"the token file {path} is open to other users "
                f"(mode {stat.S_IMODE(mode):04o}); make it owner-only: chmod 600 {path}"
            )
        token = _token_text(_read_at_most(fd, TOKEN_MAX_BYTES + 1))
    except OSError as exc:  # a directory, an I/O error
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if token is None:
        raise TokenFileError(
            f"the token file {path} holds no token (empty, not UTF-8, "
            f"or over {TOKEN_MAX_BYTES} bytes)"
        )
    return token


def runtime_token(path: Path) -> tuple[str, bool]:
    """The token kept at `path` in the private runtime dir, and whether it was written now.

    An earlier run's token is reused when its file is ours, owner-only and holds one, so that
    clients configured with it keep working after the daemon restarts (delete the file for a new
    one). A file open to others is replaced by a new token, atomically. A symbolic link, or a
    file that is not a regular file of ours, is refused: nothing is written through a link.
    """
    try:
        token = _own_token(path)
    except FileNotFoundError:
        token = new_token()
        _create_token_file(path, token)
        return token, True
    if token is not None:
        return token, False
    token = new_token()
    _replace_token_file(path, token)
    return token, True


def _own_token(path: Path) -> str | None:
    """The token in our private file at `path`; None when the file is ours but not fit to reuse.
    Raises FileNotFoundError when nothing is there, TokenFileError when something foreign is."""
    try:  # O_NONBLOCK: a FIFO planted there can't stall the start (no effect on a regular file)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if os.path.islink(path):
            raise TokenFileError(
                f"{path} is a symbolic link; remove it (a token is never written through a link)"
            ) from exc
        raise TokenFileError(f"cannot open the token file {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenFileError(f"{path} is not a regular file; remove it")
        if info.st_uid != os.geteuid():
            raise TokenFileError(
                f"{path} belongs to uid {info.st_uid}, not to this user; remove it"
            )
        if info.st_mode & 0o077 or info.st_nlink != 1:
            return None  # others may have read it, or it is reachable under another name
        return _token_text(_read_at_most(fd, TOKEN_MAX_BYTES + 1))
    finally:
        os.close(fd)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _token_text(data: bytes) -> str | None:
    if len(data) > TOKEN_MAX_BYTES:
        return None
    try:
        return data.decode("utf-8").strip() or None
    except UnicodeDecodeError:
        return None


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _create_token_file(path: Path, token: str) -> None:
    try:
        fd = os.open(path, _NEW_FILE, 0o600)
    except FileExistsError as exc:
        raise TokenFileError(
            f"{path} appeared while this engine was creating it; start again"
        ) from exc
    try:
        _write_token(fd, token)
    except BaseException:
        path.unlink(missing_ok=True)  # ours: O_EXCL created it
        raise


def _replace_token_file(path: Path, token: str) -> None:
    """Write a new file beside `path`, then rename it over: readers never see a partial token,
    and a link planted at `path` meanwhile is replaced, not followed."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(temporary, _NEW_FILE, 0o600)
    try:
        _write_token(fd, token)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _write_token(fd: int, token: str) -> None:
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        f.write(token.encode("utf-8"))
        f.flush()
        os.fsync(fd)


def new_token() -> str:
    return secrets.token_urlsafe(32)
