"""The Hugging Face cache, read offline: a repo's snapshot folder, whether it holds what the
engine reads, and the models in it. The cache is `huggingface_hub`'s (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else ~/.cache/huggingface/hub), shared with vLLM, transformers and `hf download`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.hub.files import INDEX_FILE
from engine.hub.names import RepoRef

REQUIRED = ("config.json", "tokenizer.json")


def cache_dir(override: str | Path | None = None) -> Path:
    """The hub cache in use (read from huggingface_hub, which read the environment at import)."""
    if override is not None:
        return Path(override)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def snapshot_of(ref: RepoRef, cache: str | Path | None = None) -> Path | None:
    """The cached snapshot folder of `ref` (its revision through the cache's refs, or a commit
    hash), if its config.json is there; None otherwise. Never touches the network."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        ref.repo_id, "config.json", cache_dir=str(cache_dir(cache)), revision=ref.revision
    )
    return Path(found).parent if isinstance(found, str) else None


def missing_files(model_dir: Path) -> list[str]:
    """What a model folder lacks of the files the engine reads: config.json, tokenizer.json and
    its weights (every shard its index names, else at least one safetensors file)."""
    missing = [name for name in REQUIRED if not (model_dir / name).is_file()]
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return [*missing, INDEX_FILE]
        missing += sorted(s for s in shards if not (model_dir / s).is_file())
    elif not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def repo_folder(repo_id: str, cache: str | Path | None = None) -> Path:
    """Where the cache keeps a model repo (`models--Org--Name`)."""
    return cache_dir(cache) / ("models--" + repo_id.replace("/", "--"))


def repo_id_of(path: Path) -> str | None:
    """`Org/Name` when `path` is (inside) a snapshot of the hub cache, else None."""
    parts = Path(path).parts
    for i, part in enumerate(parts[:-2]):
        if parts[i + 1] == "snapshots":
            return _repo_id_of_folder(part)
    return None


def _repo_id_of_folder(name: str) -> str | None:
    # A user or organisation name never holds `--`: the first one is the `/`.
    return (
        name.removeprefix("models--").replace("--", "/", 1) if name.startswith("models--") else None
    )


@dataclass(frozen=True)
class CachedModel:
    ref: RepoRef  # the revision as the cache names it: a branch or tag, else the commit
    commit: str
    path: Path  # the snapshot folder
    partial_bytes: int  # of downloads left unfinished (`pull` resumes them)


def cached_models(cache: str | Path | None = None) -> list[CachedModel]:
    """The model snapshots in the cache that have a config.json, one per revision the cache has
    a name for (`main`, a tag), or the commit when it has none; sorted by repo id."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir(cache))
    except CacheNotFound:
        return []
    partial: dict[str, int] = {}
    for f in info.incomplete_files:
        repo = _repo_id_of_folder(Path(f.file_path).parent.parent.name)  # REPO/blobs/X.incomplete
        if repo:
            partial[repo] = partial.get(repo, 0) + f.size_on_disk
    found = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revisions = [r for r in repo.revisions if (r.snapshot_path / "config.json").is_file()]
        named = [r for r in revisions if r.refs]
        for rev in named or revisions:
            label = "main" if "main" in rev.refs else min(rev.refs, default=rev.commit_hash)
            ref = RepoRef(repo.repo_id, None if label == "main" else label)
            found.append(
                CachedModel(ref, rev.commit_hash, rev.snapshot_path, partial.get(repo.repo_id, 0))
            )
    return sorted(found, key=lambda m: (m.ref.repo_id.lower(), str(m.ref)))
