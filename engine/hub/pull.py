"""`wd-engine pull`: a hub repo's engine files into the Hugging Face cache.

Through `huggingface_hub`: its cache layout, `HF_ENDPOINT` (mirrors), `HF_TOKEN` (gated and
private repos), `HF_HUB_OFFLINE` and its progress bars. Before any weight is fetched: the revision
is pinned to one commit, the files chosen from its listing (engine.hub.files), config.json read
for the architecture and the weights' format (`include_format` must match), and the disk's free
space checked. The weight files are fetched so that an interrupted pull continues them
(engine.hub.resume) and checked against their sha256; then `snapshot_download` fetches the small
files and links everything into the snapshot, and each file it fetched is checked against the
hub's checksum too (the git blob id of a small file). A mismatch is removed from the cache.

When the hub cannot be reached (or `HF_HUB_OFFLINE` is set), a complete copy in the cache is
enough: the pull says so and succeeds without checking for a newer revision.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine.hub import cache as hub_cache
from engine.hub.files import (
    INDEX_FILE,
    UnsupportedWeights,
    engine_files,
    format_matches,
    weight_files,
    weights_format,
)
from engine.hub.names import RepoRef
from engine.hub.resume import ResumeError, blob_path, fetch_blob, partial_path, resumable
from engine.hub.sizes import size_text
from engine.model.config import SUPPORTED_ARCHITECTURES

_HASH_CHUNK = 8 << 20
_WEIGHT_WORKERS = 4  # weight files downloaded at once


class PullError(RuntimeError):
    """The pull cannot be done (or finished); the message says why and what to do."""


@dataclass(frozen=True)
class PullResult:
    ref: RepoRef
    commit: str
    path: Path  # the snapshot folder: a model folder for --model
    format: str | None  # None when found offline and config.json says nothing readable
    total_bytes: int  # the engine files' size
    fetched_bytes: int  # what this pull downloaded (the rest was in the cache already)
    offline: bool  # found in the cache without asking the hub


def pull(
    ref: RepoRef,
    include_format: str | None = None,
    cache: str | Path | None = None,
    say: Callable[[str], None] | None = None,
) -> PullResult:
    """Download `ref`'s engine files into the hub cache (resuming what an earlier pull left) and
    return where they are. PullError for every refusal and failure, with what to do."""
    import httpx2
    from huggingface_hub import HfApi, ResolvedRevision, constants
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )

    say = say or (lambda line: print(line, file=sys.stderr))
    cache_path = hub_cache.cache_dir(cache)
    if constants.is_offline_mode():
        return _from_cache(ref, cache_path, "HF_HUB_OFFLINE is set", say)
    api = HfApi()
    try:
        # The model's info names the commit: every later call is pinned to it. (Not the client's
        # resolve_revision: it falls back to the cache's ref, and the listing then retries an
        # unreachable hub for half a minute.)
        info = api.model_info(ref.repo_id, revision=ref.revision)
        revision = ResolvedRevision(info.sha, initial=ref.revision, repo_id=ref.repo_id)
        listing = _listing(api, ref, info.sha)
        return _download(ref, revision, listing, include_format, cache_path, say)
    except (httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        if isinstance(exc, httpx2.ProxyError):
            message = f"the proxy refused the connection to {_endpoint()}: {exc}"
            raise PullError(message) from exc
        return _from_cache(ref, cache_path, f"{_endpoint()} cannot be reached ({exc})", say)
    except HfHubHTTPError as exc:
        raise PullError(_hub_error_text(ref, exc)) from exc


def _hub_error_text(ref: RepoRef, exc: Exception) -> str:
    """The hub's refusal in words, with the usual fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = _endpoint()
    if isinstance(exc, GatedRepoError):
        return (
            f"{ref.repo_id} is gated: accept its conditions on its page at {where}, then set "
            "HF_TOKEN to an access token of that account (or run `hf auth login`)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return f"no model {ref.repo_id} at {where} (check the name; a private repo needs HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return f"{ref.repo_id} has no revision {ref.revision!r} at {where}"
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"{ref}: a listed file is missing at {where}: {exc}"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 401:
        return f"{where} refused the token for {ref.repo_id} (HF_TOKEN): {exc}"
    return f"{ref}: {where} answered with an error: {str(exc).splitlines()[0]}"


def _listing(api, ref: RepoRef, commit: str) -> dict:
    """path -> RepoFile of every file of the repo at `commit`."""
    from huggingface_hub.hf_api import RepoFile

    tree = api.list_repo_tree(ref.repo_id, revision=commit, recursive=True)
    return {f.path: f for f in tree if isinstance(f, RepoFile)}


def _download(ref, revision, listing, include_format, cache_path, say) -> PullResult:
    from huggingface_hub import hf_hub_download, snapshot_download

    commit = revision.resolved
    storage = hub_cache.repo_folder(ref.repo_id, cache_path)
    snapshot = storage / "snapshots" / commit
    present = {p for p in listing if (snapshot / p).is_file()}  # before this pull
    if "config.json" not in listing:
        raise PullError(f"{ref} has no config.json at its top level: not a model folder")

    def fetch_json(name: str) -> dict:
        path = hf_hub_download(ref.repo_id, name, revision=revision, cache_dir=cache_path)
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise PullError(f"{ref}: {name} is not JSON: {exc}") from exc

    config = fetch_json("config.json")
    architecture = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise PullError(
            f"{ref} is a {architecture} model; this engine runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Qwen3-MoE, e.g. Qwen3-Coder-30B-A3B)"
        )
    try:
        fmt = weights_format(config)
    except UnsupportedWeights as exc:
        raise PullError(f"{ref}: {exc}") from exc
    if include_format and not format_matches(fmt, include_format):
        raise PullError(_wrong_format(ref, fmt, include_format))
    weight_map = fetch_json(INDEX_FILE).get("weight_map") if INDEX_FILE in listing else None
    wanted = engine_files(listing, weight_map)
    if not weight_files(wanted):
        raise PullError(
            f"{ref} has no safetensors weights at its top level; the engine reads Hugging Face "
            "safetensors folders"
        )
    absent = sorted(set(weight_map.values()) - set(listing)) if weight_map else []
    if absent:
        raise PullError(f"{ref}: its {INDEX_FILE} names files the repo lacks: {absent[:3]}")

    new = [listing[p] for p in wanted if p not in present]
    own = [e for e in new if resumable(e)]  # weights, continued across pulls (engine.hub.resume)
    total = sum(listing[p].size for p in wanted)
    to_fetch = sum(e.size for e in new)
    partial = sum(_size(partial_path(storage, e)) for e in own)
    _check_disk(cache_path, to_fetch - partial)
    say(
        f"{ref}: {len(wanted)} files, {size_text(total)} in {fmt}, commit {commit[:12]}"
        + (f"; {size_text(to_fetch)} to download" if len(new) < len(wanted) else "")
        + (f", {size_text(partial)} of it from an interrupted pull" if partial else "")
    )
    made = _fetch_weights(ref, commit, own, storage, cache_path / ".locks")
    path = snapshot_download(
        ref.repo_id,
        revision=revision,
        cache_dir=cache_path,
        allow_patterns=[glob.escape(p) for p in wanted],
    )
    path = Path(path)
    _drop_unlinked(path, made, storage)
    _verify(ref, path, storage, [e for e in new if e not in own], say)
    _name_revision(storage, ref, commit)
    return PullResult(ref, commit, path, fmt, total, to_fetch, offline=False)


def _endpoint() -> str:
    """The hub's address for messages, without any user:password@ it carries."""
    from urllib.parse import urlsplit, urlunsplit

    from huggingface_hub import constants

    parts = urlsplit(constants.ENDPOINT)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=host))


def _remove_snapshot_file(file: Path, storage: Path) -> None:
    """A snapshot file and, where it is the cache's link to a blob, that blob; never a file
    outside the repo's blob store, nor a link planted there."""
    blob = None
    if file.is_symlink():
        target = (file.parent / os.readlink(file)).resolve(strict=False)
        blobs = (storage / "blobs").resolve()
        candidate = blobs / target.name
        if target.parent == blobs and not candidate.is_symlink():
            blob = candidate
    file.unlink(missing_ok=True)
    if blob is not None:
        blob.unlink(missing_ok=True)


def _drop_unlinked(path: Path, made: list, storage: Path) -> None:
    """A blob this pull made that the hub client did not link (it named the file otherwise and
    fetched it again) is only taking space. Blobs that were there before are left alone: another
    snapshot may link them."""
    for entry in made:
        blob = blob_path(storage, entry)
        if blob.exists() and (path / entry.path).resolve() != blob.resolve():
            blob.unlink()


def _name_revision(storage: Path, ref: RepoRef, commit: str) -> None:
    """Record that `ref`'s revision (default: main) is `commit`, as the cache's `refs/` does, so
    that the repo id finds this snapshot offline; written once the snapshot is complete."""
    from huggingface_hub import constants

    name = ref.revision or constants.DEFAULT_REVISION
    if name == commit:
        return
    path = storage / "refs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(commit)
    os.replace(temp, path)


def _fetch_weights(ref: RepoRef, commit: str, entries: list, storage: Path, locks: Path) -> list:
    """The weight files into the blob store, a few at a time, under one progress bar; returns
    the entries whose blobs this pull made."""
    if not entries:
        return []
    from huggingface_hub.utils import tqdm

    have = sum(_size(partial_path(storage, e)) for e in entries)
    lock = threading.Lock()
    with tqdm(
        total=sum(e.size for e in entries),
        initial=have,
        unit="B",
        unit_scale=True,
        desc=f"Downloading {len(entries)} weight file" + ("s" if len(entries) > 1 else ""),
        name="huggingface_hub.snapshot_download",  # silenced as the client's own bars are
    ) as bar:

        class Progress:
            @staticmethod
            def update(n: int) -> None:
                with lock:
                    bar.update(n)

        def fetch(entry) -> bool:
            return fetch_blob(ref.repo_id, commit, entry, storage, locks, Progress)

        try:
            with ThreadPoolExecutor(max_workers=min(_WEIGHT_WORKERS, len(entries))) as pool:
                made = list(pool.map(fetch, entries))
        except ResumeError as exc:
            raise PullError(f"{ref}: {exc}; run `wd-engine pull {ref}` again") from exc
    return [entry for entry, new in zip(entries, made) if new]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wrong_format(ref: RepoRef, fmt: str, wanted: str) -> str:
    message = f"{ref} holds {fmt} weights, not {wanted}"
    if fmt in ("fp8", "int4") or wanted == "bf16":
        return message + f": pull a repo of {wanted} weights"
    return (
        f"{message}: pull a repo of {wanted} weights, or pull this one without --include-format "
        f"and quantize it: `wd-engine quantize --to {wanted} {ref} DST`"
    )


def _check_disk(cache_path: Path, needed: int) -> None:
    """PullError when the cache's disk has less free space than the download."""
    where = cache_path
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed > free:
        raise PullError(
            f"the download needs {size_text(needed)} but {where} has {size_text(free)} free "
            "(HF_HUB_CACHE or HF_HOME puts the cache elsewhere)"
        )


def _verify(ref: RepoRef, path: Path, storage: Path, fetched: list, say) -> None:
    """Check the files this pull downloaded against the hub's checksums; a mismatch is removed
    (the snapshot's link and its blob) so that the next pull fetches it again."""
    if not fetched:
        return
    say(f"checking {len(fetched)} downloaded files against the hub's checksums")
    for entry in fetched:
        file = path / entry.path
        if entry.lfs is not None:
            expected, actual = entry.lfs.sha256, _sha256(file)
        else:
            expected, actual = entry.blob_id, _git_blob_id(file)
        if actual != expected:
            _remove_snapshot_file(file, storage)
            raise PullError(
                f"{ref}: {entry.path} does not match the hub's checksum ({expected}, got "
                f"{actual}); it was removed: run `wd-engine pull {ref}` again"
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _git_blob_id(path: Path) -> str:
    """Git's object id of a file: sha1 of `blob SIZE\\0` and the content."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _from_cache(ref: RepoRef, cache_path: Path, why: str, say) -> PullResult:
    """The hub is out of reach: a complete copy in the cache will do."""
    snapshot = hub_cache.snapshot_of(ref, cache_path)
    if snapshot is None:
        raise PullError(f"{why}, and {ref} is not in the Hugging Face cache ({cache_path})")
    missing = hub_cache.missing_files(snapshot)
    if missing:
        raise PullError(
            f"{why}, and the copy of {ref} in the cache is incomplete (missing "
            f"{', '.join(missing[:3])}): run the pull again once the hub can be reached"
        )
    say(f"{why}: {ref} is in the cache, not checked for a newer revision")
    try:
        fmt = weights_format(json.loads((snapshot / "config.json").read_text()))
    except (OSError, ValueError):
        fmt = None
    size = sum(p.stat().st_size for p in snapshot.iterdir() if p.is_file())
    return PullResult(ref, snapshot.name, snapshot, fmt, size, 0, offline=True)
