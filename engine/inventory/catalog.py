"""The models on this machine: the embedded ones (the default first), `$WD_LSP_MODEL`'s, the
snapshots in the Hugging Face cache, and the model folders under the local model folders
(engine.models.local_model_dirs), each described from its config.json and safetensors headers
alone (no weight is read)."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from engine.hub.cache import cached_models, missing_files
from engine.hub.files import UnsupportedWeights, weights_format
from engine.models import (
    MODEL_ENV_VAR,
    ModelNotFound,
    default_model_dir,
    embedded_model_dirs,
    local_model_dirs,
)

_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


@dataclass(frozen=True)
class LocalModel:
    name: str  # what `--model` takes for it: a repo id, a folder name, or the folder's path
    path: Path
    source: str  # "embedded", "hub cache", "models folder", WD_LSP_MODEL
    architecture: str | None = None
    format: str | None = None  # "fp8", "int4", "bf16", "fp16", "fp32"
    size_bytes: int = 0  # on disk
    context: int | None = None  # max_position_embeddings
    problem: str | None = None  # why the engine cannot run it as it is
    repo_id: str | None = None  # for a hub snapshot


@dataclass(frozen=True)
class Catalog:
    models: list[LocalModel]
    default: Path | None  # the folder the daemon loads without a `model` setting
    default_problem: str | None  # why $WD_LSP_MODEL names nothing, when it does not


def find_models(cache: str | Path | None = None) -> Catalog:
    """Every model found (a folder once, under its first name), and the default."""
    try:
        default, default_problem = default_model_dir(), None
    except ModelNotFound as exc:
        default, default_problem = None, f"{MODEL_ENV_VAR}={os.environ.get(MODEL_ENV_VAR)}: {exc}"
    found: list[LocalModel] = [
        describe(path, path.name, "embedded") for path in embedded_model_dirs()
    ]
    for cached in cached_models(cache):
        found.append(
            describe(cached.path, str(cached.ref), "hub cache", repo_id=cached.ref.repo_id)
        )
    for folder in local_model_dirs():
        for path in _model_folders(folder):
            found.append(describe(path, path.name, "models folder"))
    if default is not None and default.is_dir():
        found.append(describe(default, str(default), MODEL_ENV_VAR))
    unique, seen, names = [], set(), set()
    for model in found:
        key = _identity(model.path)
        if key in seen:
            continue
        seen.add(key)
        if model.name in names:  # a second folder of one name: by its path
            model = LocalModel(**{**model.__dict__, "name": str(model.path)})
        names.add(model.name)
        unique.append(model)
    return Catalog(unique, default, default_problem)


def is_default(model: LocalModel, catalog: Catalog) -> bool:
    return catalog.default is not None and _identity(model.path) == _identity(catalog.default)


def _identity(path: Path) -> str:
    try:
        return str(Path(path).resolve())
    except OSError:
        return str(path)


def _model_folders(folder: Path) -> list[Path]:
    """`folder` itself when it is a model folder, else its subfolders that are."""
    if (folder / "config.json").is_file():
        return [folder]
    try:
        return sorted(p for p in folder.iterdir() if (p / "config.json").is_file())
    except OSError:
        return []


def describe(path: Path, name: str, source: str, repo_id: str | None = None) -> LocalModel:
    """A model folder's facts; `problem` says what keeps the engine from running it."""
    from engine.model.config import SUPPORTED_ARCHITECTURES

    path = Path(path)
    base = dict(name=name, path=path, source=source, repo_id=repo_id, size_bytes=_disk_size(path))
    try:
        config = json.loads((path / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return LocalModel(**base, problem=f"unreadable config.json: {exc}")
    architecture = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    context = config.get("max_position_embeddings")
    base.update(architecture=architecture, context=context if isinstance(context, int) else None)
    try:
        fmt = weights_format(config)
    except UnsupportedWeights as exc:
        return LocalModel(**base, problem=str(exc))
    if architecture not in SUPPORTED_ARCHITECTURES:
        return LocalModel(**base, format=fmt, problem=f"architecture {architecture} unsupported")
    missing = missing_files(path)
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        what = "partly downloaded" if repo_id else "incomplete"
        fix = f": finish it with `wd-engine pull {name}`" if repo_id else ""
        return LocalModel(
            **base, format=fmt, problem=f"{what} (missing {', '.join(missing[:3])}{more}){fix}"
        )
    if fmt not in ("fp8", "int4"):
        fmt = _stored_dtype(path) or fmt
    return LocalModel(**base, format=fmt)


def _stored_dtype(path: Path) -> str | None:
    """The dtype most of an unquantized folder's weights are stored in (headers only)."""
    from engine.loading.memory import read_headers
    from engine.model.config import ModelFormatError

    try:
        headers = read_headers(path)
    except (ModelFormatError, OSError, ValueError):
        return None
    counts = Counter(info.get("dtype") for info in headers.values() if isinstance(info, dict))
    for dtype, _ in counts.most_common():
        if dtype in _DTYPES:
            return _DTYPES[dtype]
    return None


def _disk_size(path: Path) -> int:
    """The bytes of a folder's files, links followed (a hub snapshot links to its blobs)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
