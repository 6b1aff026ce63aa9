"""Weight files fetched so that an interrupted pull continues where it stopped.

`huggingface_hub` 2.x downloads each file into a temporary file of its own process, dropped when
the process ends, so a pull stopped mid-shard starts that shard again from its first byte (a
Qwen3-30B shard is ~4 GB); its Xet transfers likewise. Here a weight file (an LFS file of the
repo; the hub serves Xet-stored ones over HTTP too) goes into the cache's blob store as the hub
client names it, `blobs/<sha256>`, through `blobs/<sha256>.incomplete`, the name the client
itself used before 2.x and that `hf cache` still lists as an unfinished download: the next pull
asks for the rest with `Range: bytes=N-`. The hub client's per-blob lock is held meanwhile, the
whole file is checked against its sha256 before it takes its name, and `snapshot_download` then
links it into the snapshot as if it had fetched it.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

_READ = 1 << 20
_ATTEMPTS = 5  # tries in a row that add nothing before giving up


class ResumeError(RuntimeError):
    pass


def resumable(entry) -> bool:
    """Whether this pull fetches the file itself: the LFS files (the weights)."""
    return entry.lfs is not None


def _checked_sha256(entry) -> str:
    """The entry's sha256 as a file name: 64 hex digits, nothing a server could turn into a path
    outside the blob store."""
    sha = entry.lfs.sha256
    if not re.fullmatch(r"[0-9a-f]{64}", str(sha)):
        raise ResumeError(f"{entry.path}: the hub sent {sha!r}, not a sha256")
    return sha


def blob_path(storage: Path, entry) -> Path:
    return storage / "blobs" / _checked_sha256(entry)


def partial_path(storage: Path, entry) -> Path:
    return storage / "blobs" / f"{_checked_sha256(entry)}.incomplete"


def fetch_blob(repo_id: str, commit: str, entry, storage: Path, locks: Path, progress) -> bool:
    """Make `blobs/<sha256>` of `entry` in the repo's cache folder `storage`, continuing a
    partial download; `progress.update(n)` for each n bytes received. True when this call made
    the blob, False when it was there already. ResumeError when the file cannot be had (or does
    not match its checksum: the partial file is then removed)."""
    from huggingface_hub.utils import WeakFileLock

    blob = blob_path(storage, entry)
    if blob.exists():
        return False
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = locks / storage.name / f"{entry.lfs.sha256}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():  # another process finished it meanwhile
            return False
        partial = partial_path(storage, entry)
        stalled = 0  # tries in a row that added nothing
        while (have := _size(partial)) < entry.size:
            error = None
            try:
                _fetch_rest(repo_id, commit, entry, partial, have, progress)
            except Exception as exc:  # noqa: BLE001 - a dropped connection is tried again
                if not _is_transport_error(exc):
                    raise ResumeError(f"{entry.path}: {exc}") from exc
                error = exc
            stalled = 0 if _size(partial) > have else stalled + 1
            if stalled >= _ATTEMPTS:
                why = f": {error}" if error else ""
                raise ResumeError(f"{entry.path}: nothing more came in {_ATTEMPTS} tries{why}")
            if stalled:
                time.sleep(stalled)
        if _size(partial) > entry.size or _sha256(partial) != entry.lfs.sha256:
            partial.unlink(missing_ok=True)
            raise ResumeError(
                f"{entry.path} does not match the hub's sha256 {entry.lfs.sha256}: removed"
            )
        os.replace(partial, blob)
        return True


def _fetch_rest(repo_id: str, commit: str, entry, partial: Path, have: int, progress) -> None:
    """One GET of what is missing, appended to the partial file (restarted when the server
    ignores the range)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"  # the bytes as stored: the range counts them
    if have:
        headers["Range"] = f"bytes={have}-"
    url = hf_hub_url(repo_id, entry.path, revision=commit)
    with get_session().stream(
        "GET",
        url,
        headers=headers,
        follow_redirects=True,
        timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
    ) as response:
        hf_raise_for_status(response)
        if have and response.status_code != 206:
            progress.update(-have)
            have = 0
        # Never through a link planted at the partial file's name.
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(partial, flags, 0o644), "wb") as f:
            f.seek(have)
            f.truncate()
            for chunk in response.iter_bytes():  # as it arrives: the file is what came
                f.write(chunk)
                progress.update(len(chunk))


def _is_transport_error(exc: Exception) -> bool:
    import httpx2

    return isinstance(exc, httpx2.TransportError)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * _READ):
            digest.update(chunk)
    return digest.hexdigest()
