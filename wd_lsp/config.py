"""Server settings: defaults, overridden by `initializationOptions` and then by
`workspace/didChangeConfiguration` ({"settings": {"wdLsp": {...}}}). Unknown keys are ignored and
bad values keep the previous setting, each with a logged warning: a typo in an editor's settings
must never stop completions."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from engine.ipc.protocol import MAX_BEAMS, MAX_COMPLETIONS

MODEL_ENV_VAR = "WD_LSP_MODEL"
MULTILINE_POLICIES = ("auto", "single", "multi")
BACKENDS = ("engine", "openai")
FIM_MODES = ("template", "suffix")
DEBOUNCE_MODES = ("adaptive", "fixed")
# Defaults from the environment, for editors whose settings UI lacks these keys (VS Code's
# `wdLsp.server.env` passes them) and to keep keys out of settings files.
BACKEND_ENV_VAR = "WD_LSP_BACKEND"
OPENAI_URL_ENV_VAR = "WD_LSP_OPENAI_BASE_URL"
OPENAI_KEY_ENV_VAR = "WD_LSP_OPENAI_API_KEY"
OPENAI_MODEL_ENV_VAR = "WD_LSP_OPENAI_MODEL"


def _env(name: str, default=None, allowed=None):
    value = os.environ.get(name) or None
    return value if value is not None and (allowed is None or value in allowed) else default


@dataclass(frozen=True)
class EngineAddress:
    socket: str | None = None  # Unix socket of a running engine (default: the per-user one)
    tcp: str | None = None  # "host:port" of a shared engine
    token: str | None = None  # required with tcp
    auto_start: bool = True  # spawn the daemon when no engine listens


@dataclass(frozen=True)
class OpenAIServer:
    """An OpenAI-compatible /v1/completions server (vLLM, SGLang, llama.cpp,
    `wd-engine serve --http-port`)."""

    base_url: str = field(
        default_factory=lambda: _env(OPENAI_URL_ENV_VAR, "http://127.0.0.1:8000/v1")
    )
    api_key: str | None = field(default_factory=lambda: _env(OPENAI_KEY_ENV_VAR))
    model: str | None = field(
        default_factory=lambda: _env(OPENAI_MODEL_ENV_VAR)
    )  # None: the first one listed
    # "template": the client writes the Qwen-Coder FIM prompt (works everywhere);
    # "suffix": the server builds it from OpenAI's `suffix` parameter (our engine, SGLang with a
    # completion template; vLLM refuses `suffix`).
    fim: str = "template"


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    model: str | None = field(default_factory=lambda: os.environ.get(MODEL_ENV_VAR) or None)
    engine: EngineAddress = EngineAddress()
    # "engine": the resident daemon; "openai": an OpenAI-compatible server
    backend: str = field(default_factory=lambda: _env(BACKEND_ENV_VAR, "engine", BACKENDS))
    openai: OpenAIServer = field(default_factory=OpenAIServer)
    # "adaptive": the wait follows the user's typing speed and the engine's latency
    # (wd_lsp.debounce); "fixed": always `debounce_ms`, which is also the adaptive wait until the
    # document has seen some typing.
    debounce: str = "adaptive"
    debounce_ms: int = 60
    max_tokens: int = 64
    multiline: str = "auto"
    max_lines: int = 16
    enabled_languages: tuple[str, ...] = ("*",)
    temperature: float = 0.0
    # Single-line completions by beam search over this many hypotheses (1: greedy); more exact
    # lines for a little more time (BENCHMARKS.md, "Beam search for single-line completions").
    beams: int = 2
    # Distinct inline suggestions per request at most, best first (1: one, as before).
    suggestions: int = 3
    warm_on_change: bool = True
    request_timeout_ms: int = 10_000

    def language_enabled(self, language_id: str) -> bool:
        return "*" in self.enabled_languages or language_id in self.enabled_languages


# camelCase key -> (field, check)
_FIELDS = {
    "enabled": ("enabled", lambda v: isinstance(v, bool)),
    "model": ("model", lambda v: v is None or isinstance(v, str)),
    "debounce": ("debounce", lambda v: v in DEBOUNCE_MODES),
    "debounceMs": (
        "debounce_ms",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 5000,
    ),
    "maxTokens": (
        "max_tokens",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1024,
    ),
    "multiline": ("multiline", lambda v: v in MULTILINE_POLICIES),
    "maxLines": (
        "max_lines",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 200,
    ),
    "enabledLanguages": (
        "enabled_languages",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
    "temperature": (
        "temperature",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2,
    ),
    "beams": (
        "beams",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_BEAMS,
    ),
    "suggestions": (
        "suggestions",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_COMPLETIONS,
    ),
    "warmOnChange": ("warm_on_change", lambda v: isinstance(v, bool)),
    "requestTimeoutMs": (
        "request_timeout_ms",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    ),
    "backend": ("backend", lambda v: v in BACKENDS),
}
_ENGINE_FIELDS = {
    "socket": ("socket", lambda v: v is None or isinstance(v, str)),
    "tcp": ("tcp", lambda v: v is None or (isinstance(v, str) and v.rpartition(":")[2].isdigit())),
    "token": ("token", lambda v: v is None or isinstance(v, str)),
    "autoStart": ("auto_start", lambda v: isinstance(v, bool)),
}
_OPENAI_FIELDS = {
    "baseUrl": ("base_url", lambda v: isinstance(v, str) and v.startswith(("http://", "https://"))),
    "apiKey": ("api_key", lambda v: v is None or isinstance(v, str)),
    "model": ("model", lambda v: v is None or isinstance(v, str)),
    "fim": ("fim", lambda v: v in FIM_MODES),
}
_SECTIONS = {"engine": _ENGINE_FIELDS, "openai": _OPENAI_FIELDS}


def merge_settings(current: Settings, raw, warn=lambda message: None) -> Settings:
    """`raw` is the client's map (either the `wdLsp` section itself or a map holding it)."""
    if not isinstance(raw, dict):
        if raw is not None:
            warn(f"ignoring settings that are not a map: {raw!r}")
        return current
    if isinstance(raw.get("wdLsp"), dict):
        raw = raw["wdLsp"]
    changes = {}
    for key, value in raw.items():
        if key in _SECTIONS:
            if isinstance(value, dict):
                changes[key] = _merge(getattr(current, key), value, _SECTIONS[key], warn, f"{key}.")
            else:
                warn(f"ignoring setting {key!r}: expected a map")
        elif key in _FIELDS:
            name, ok = _FIELDS[key]
            if ok(value):
                changes[name] = tuple(value) if isinstance(value, list) else value
            else:
                warn(f"ignoring setting {key!r}: bad value {value!r}")
        else:
            warn(f"ignoring unknown setting {key!r}")
    return replace(current, **changes)


def _merge(current, raw: dict, fields: dict, warn, prefix: str):
    changes = {}
    for key, value in raw.items():
        if key not in fields:
            warn(f"ignoring unknown setting {prefix}{key!r}")
            continue
        name, ok = fields[key]
        if ok(value):
            changes[name] = value
        else:
            warn(f"ignoring setting {prefix}{key}: bad value {value!r}")
    return replace(current, **changes)
