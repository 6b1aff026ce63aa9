"""Models shipped inside the package (the default one runs with no download), and what a model
name means: `resolve_model` turns the `model` setting (`--model`, `$WD_LSP_MODEL`, the editor's
setting) into a model folder."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
# The embedded default model's folder name under engine/models/. The package ships one more,
# `wd-coder-tiny`, the earlier default: smaller and weaker, named by `--model wd-coder-tiny`.
DEFAULT_MODEL_NAME = "wd-coder-small"
MODEL_ENV_VAR = "WD_LSP_MODEL"
# Folders holding model folders (os.pathsep-separated), listed by `wd-engine models` and looked in
# for a bare model name; the user's data folder is always one of them.
MODEL_DIRS_ENV_VAR = "WD_ENGINE_MODEL_DIRS"


class ModelNotFound(LookupError):
    """A model name names nothing on this machine; the message says how to fetch it."""


def embedded_model_dir() -> Path:
    return MODELS_DIR / DEFAULT_MODEL_NAME


def embedded_model_dirs() -> list[Path]:
    """Every model folder shipped in the package, the default first."""
    others = sorted(
        p
        for p in MODELS_DIR.iterdir()
        if (p / "config.json").is_file() and p.name != DEFAULT_MODEL_NAME
    )
    return [embedded_model_dir(), *others]


def default_model_dir() -> Path:
    """`WD_LSP_MODEL` if set (resolved as `resolve_model` does), else the embedded default
    model."""
    override = os.environ.get(MODEL_ENV_VAR)
    return resolve_model(override) if override else embedded_model_dir()


def user_models_dir() -> Path:
    """`$XDG_DATA_HOME/wd-lsp/models`: where quantized copies are suggested to go."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "wd-lsp" / "models"


def local_model_dirs() -> list[Path]:
    """The folders searched for model folders: `$WD_ENGINE_MODEL_DIRS`, then `user_models_dir`."""
    listed = [
        Path(p).expanduser() for p in os.environ.get(MODEL_DIRS_ENV_VAR, "").split(os.pathsep)
    ]
    dirs = [p for p in listed if str(p) not in ("", ".")] + [user_models_dir()]
    return list(dict.fromkeys(dirs))


def resolve_model(name: str | os.PathLike | None, cache: str | Path | None = None) -> Path:
    """The model folder a model name means, found without any download:

    - None or empty: `default_model_dir()`;
    - a path to a folder: that folder;
    - a Hugging Face repo id, `Org/Name` or `Org/Name@REVISION`: its snapshot in the hub cache
      (engine.hub.cache; `cache` overrides the cache folder);
    - a bare folder name found under `local_model_dirs()`, or an embedded model's name.

    ModelNotFound, naming `wd-engine pull` for a repo id, when it means nothing here (a path
    that is no folder is returned as it is: loading it says what is wrong)."""
    if name is None or str(name) == "":
        return default_model_dir()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    text = str(name)
    from engine.hub.names import looks_like_repo_ref, parse_repo_ref

    if looks_like_repo_ref(text) and not text.startswith(("./", "../", "/", "~")):
        return _from_hub_cache(parse_repo_ref(text), cache)
    if os.sep not in text and "/" not in text:
        for folder in [*local_model_dirs(), MODELS_DIR]:
            if (folder / text / "config.json").is_file():
                return folder / text
    return path


def _from_hub_cache(ref, cache) -> Path:
    from engine.hub import cache as hub_cache

    snapshot = hub_cache.snapshot_of(ref, cache)
    where = hub_cache.cache_dir(cache)
    if snapshot is None:
        raise ModelNotFound(
            f"model {ref} is not downloaded (no folder {ref} and nothing in the Hugging Face cache "
            f"{short_path(where)}): fetch it with `wd-engine pull {ref}`"
        )
    missing = hub_cache.missing_files(snapshot)
    if missing:
        raise ModelNotFound(
            f"model {ref} is only partly downloaded (missing {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): finish it with `wd-engine pull {ref}`"
        )
    return snapshot


def display_name(model_dir: str | os.PathLike) -> str:
    """How a model folder is named to people: `Org/Name` for a snapshot in the hub cache (whose
    folder is a commit hash), else the folder's name."""
    from engine.hub.cache import repo_id_of

    return repo_id_of(Path(model_dir)) or Path(model_dir).name


def short_path(path: Path) -> str:
    """`~/...` for a path under the home folder."""
    home = Path.home()
    try:
        return "~/" + str(Path(path).relative_to(home))
    except ValueError:
        return str(path)
