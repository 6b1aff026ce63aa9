"""Completions from any OpenAI-compatible server (vLLM, SGLang, llama.cpp, or our engine's
`--http-port` endpoint): the same interface as `EngineLink`, so the server can use either.

FIM goes either through the server's `suffix` parameter or, by default, as a client-side
Qwen-Coder prompt (`<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`, with other files' snippets
before it as `<|file_sep|>` blocks, the layout the model was trained on). Answers stream over
server-sent events; a stop rule firing, a cancelled LSP request or a superseded one closes the
stream, which is how such servers learn to stop. Failures raise `EngineUnavailable` after ONE
logged message (until a request succeeds again): the server turns them into empty completions.
Imports no torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace

import httpx

from engine.ipc.client import EngineUnavailable

from .config import Settings
from .context import CompletionContext
from .engine_link import CLIENT_GRACE_S, EngineAnswer, Sampling
from .shape import StopRules, apply_stop_rules

log = logging.getLogger(__name__)

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FILE_SEP = (
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|file_sep|>",
)
# Tokens that end a Qwen-Coder infill when the server does not treat them as end of sequence;
# the FIM markers last (a remote server cannot be told never to sample them, so they end it too).
TEMPLATE_STOPS = (
    "<|endoftext|>",
    FILE_SEP,
    "<|fim_pad|>",
    "<|im_end|>",
    FIM_SUFFIX,
    FIM_MIDDLE,
    FIM_PREFIX,
)
MAX_SERVER_STOPS = 4  # OpenAI's own limit; the rest are applied here while streaming
CONNECT_TIMEOUT_S = 5.0


def fim_template_prompt(ctx: CompletionContext) -> str:
    """The Qwen-Coder file-level FIM prompt, other files' snippets first."""
    context = "".join(f"{FILE_SEP}{c.path}\n{c.text.rstrip()}\n" for c in ctx.chunks)
    header = f"{FILE_SEP}{ctx.path}\n" if ctx.chunks and ctx.path else ""
    return f"{context}{header}{FIM_PREFIX}{ctx.prefix}{FIM_SUFFIX}{ctx.suffix}{FIM_MIDDLE}"


class OpenAIBackend:
    def __init__(self, on_state: Callable[[str, str], None], on_progress: Callable[[str], None]):
        self.on_state = on_state  # (state, message), as EngineLink reports them
        self.on_progress = on_progress
        self.settings: Settings | None = None
        self.http: httpx.AsyncClient | None = None
        self.state = "idle"
        self.model_info: dict | None = None
        self.model: str | None = None
        self.counters = dict(requests=0, errors=0, context_retries=0)
        self._context_logged = False  # a context refusal is logged once
        self._error_logged = False

    def configure(self, settings: Settings) -> None:
        """New settings; a changed server takes effect at the next request."""
        old = self.settings
        self.settings = settings
        if old is not None and old.openai != settings.openai:
            self.disconnect()
            self._error_logged = False  # new settings, new problems: say the next one too

    async def ensure_connected(self) -> httpx.AsyncClient:
        """Reach the server and learn the model name (the first one listed unless configured)."""
        if self.http is not None and self.model is not None:
            return self.http
        s = self.settings.openai
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        http = self.http = self.http or httpx.AsyncClient(
            base_url=s.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(
                self.settings.request_timeout_ms / 1000, connect=CONNECT_TIMEOUT_S
            ),
        )
        if self.state == "idle":
            self._set_state("starting", f"connecting to {s.base_url}")
        try:
            response = await http.get("/models")
            _raise_for_status(response)
            cards = [m for m in response.json().get("data", []) if isinstance(m, dict)]
            listed = [m.get("id") for m in cards]
        except (httpx.HTTPError, ValueError, AttributeError, EngineUnavailable) as exc:
            self._report_failure(http, exc)
            raise EngineUnavailable(_describe(exc)) from exc
        if http is not self.http:  # new settings arrived meanwhile: ask the new server
            return await self.ensure_connected()
        if s.model is None and not listed:
            self._report_failure(http, EngineUnavailable("the server lists no models"))
            raise EngineUnavailable("the server lists no models")
        self.model = s.model or listed[0]
        if s.model and listed and s.model not in listed:
            log.warning(
                "%s lists %s, not %r; trying it anyway",
                s.base_url,
                ", ".join(map(str, listed)),
                s.model,
            )
        self.model_info = {"name": self.model}
        # vLLM and the engine's own listener say the model's context: the context budget fits it.
        length = next((m.get("max_model_len") for m in cards if m.get("id") == self.model), None)
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            self.model_info["max_context"] = length
        self._error_logged = False
        self._set_state("ready", f"ready: {self.model} at {s.base_url}")
        return self.http

    async def complete(
        self,
        ctx: CompletionContext,
        rules: StopRules,
        key: str,
        n: int = 1,
        sampling: Sampling | None = None,
    ) -> EngineAnswer:
        """Stream a completion, closing the stream as soon as a stop rule fires. A server that
        refuses the prompt as longer than its model's context (the budget counts tokens by an
        estimate, and dense code has more) gets it once more with half the prefix, and the
        context the budget fits shrinks for the requests after it. One completion per request
        (`n` is not passed on: OpenAI's `n` samples, it never searches); `sampling` samples
        instead of the settings' decoding."""
        self.counters["requests"] += 1
        try:
            return await self._complete(ctx, rules, sampling)
        except ContextTooLong as exc:
            self._shrink_context(exc)
            shorter = _half_prefix(ctx)
            if shorter is None:
                self.counters["errors"] += 1
                raise
        self.counters["context_retries"] += 1
        try:
            return await self._complete(shorter, rules, sampling)
        except ContextTooLong as exc:
            self._shrink_context(exc)
            self.counters["errors"] += 1
            raise

    def _shrink_context(self, exc: ContextTooLong) -> None:
        """Fit the next prompts to 80% of the context in use (or of the one the error names)."""
        named = re.search(r"maximum context length is (\d+)", str(exc), re.IGNORECASE)
        info = self.model_info if self.model_info is not None else {}
        context = info.get("max_context") or (int(named.group(1)) if named else None)
        if context:
            info["max_context"] = max(64, int(0.8 * context))
            self.model_info = info
        if not self._context_logged:
            self._context_logged = True
            log.warning("%s; prompts now fit %s tokens", exc, info.get("max_context", "fewer"))

    async def _complete(
        self, ctx: CompletionContext, rules: StopRules, sampling: Sampling | None = None
    ) -> EngineAnswer:
        s = self.settings
        http = await self.ensure_connected()
        stops = list(rules.stop_strings)
        body = dict(
            model=self.model,
            max_tokens=s.max_tokens,
            temperature=float(s.temperature),
            stream=True,
            stream_options={"include_usage": True},
        )
        if sampling is not None:
            body.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
        if s.openai.fim == "suffix":
            body.update(prompt=ctx.prefix, suffix=ctx.suffix)
        else:
            body.update(prompt=fim_template_prompt(ctx))
            stops += [t for t in TEMPLATE_STOPS if t not in stops]
        if stops:
            body["stop"] = stops[:MAX_SERVER_STOPS]
        started = time.monotonic()
        first_token_ms = None
        text, stopped, usage = "", False, None
        guard_s = s.request_timeout_ms / 1000 + CLIENT_GRACE_S
        try:
            # Leaving this block closes the response, also on cancellation: the server sees
            # the connection go and stops generating. httpx bounds each read; this bounds the
            # whole answer, as the engine's deadline does.
            async with (
                asyncio.timeout(guard_s),
                http.stream("POST", "/completions", json=body) as response,
            ):
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for_status(response)
                async for payload in _sse_payloads(response):
                    if "error" in payload:
                        raise EngineUnavailable(_error_text(payload))
                    usage = payload.get("usage") or usage
                    for choice in payload.get("choices") or ():
                        delta = choice.get("text") or ""
                        if not delta:
                            continue
                        if first_token_ms is None:
                            first_token_ms = 1000 * (time.monotonic() - started)
                        text, stopped = apply_stop_rules(text + delta, _with_stops(rules, stops))
                    if stopped:
                        break
        except ContextTooLong:
            raise  # complete() asks again, or counts it
        except TimeoutError as exc:
            self.counters["errors"] += 1
            failure = EngineUnavailable(
                f"the server did not finish an answer within {guard_s:.1f} s"
            )
            self._report_failure(http, failure)
            raise failure from exc
        except (httpx.HTTPError, ValueError, EngineUnavailable) as exc:
            self.counters["errors"] += 1
            self._report_failure(http, exc)
            raise EngineUnavailable(_describe(exc)) from exc
        return EngineAnswer(text, stopped, usage, first_token_ms)

    async def warm(self, ctx: CompletionContext, key: str) -> None:
        """Nothing: a shared server's own prefix cache warms on real requests, and a request per
        keystroke from every editor would load a cluster for little gain."""

    async def stats(self) -> dict:
        s = self.settings.openai if self.settings else None
        return dict(
            self.counters, backend="openai", base_url=s.base_url if s else None, model=self.model
        )

    async def restart(self) -> None:
        """Forget the connection and the model name, then reach the server again."""
        self.disconnect()
        await self.ensure_connected()

    def disconnect(self) -> None:
        http, self.http, self.model = self.http, None, None
        if http is not None:
            try:
                asyncio.get_running_loop().create_task(http.aclose())
            except RuntimeError:
                pass  # no loop any more: the process is exiting

    def _report_failure(self, http: httpx.AsyncClient, exc: Exception) -> None:
        if http is not self.http:
            return  # a connection that new settings replaced while it was in use: not news
        # The server logs state changes (log file and window/logMessage): that is the one
        # message; later failures stay quiet until a request succeeds again.
        if not self._error_logged:
            self._error_logged = True
            self._set_state(
                "error",
                f"completion server unavailable: {_describe(exc)} "
                "(completions are empty until it is back)",
            )
        self.model = None  # the next request checks the server again

    def _set_state(self, state: str, message: str) -> None:
        self.state = state
        self.on_state(state, message)


def _with_stops(rules: StopRules, stops: list[str]) -> StopRules:
    return (
        rules
        if len(stops) == len(rules.stop_strings)
        else replace(rules, stop_strings=tuple(stops))
    )


async def _sse_payloads(response: httpx.Response):
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__  # some transport errors carry no message


class ContextTooLong(EngineUnavailable):
    """The server refused the prompt as longer than its model's context."""


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            detail = _error_text(response.json())
        except ValueError:
            detail = response.text[:200]
        # vLLM's and the engine's listener's wording: "This model's maximum context length is ..."
        error = (
            ContextTooLong
            if response.status_code == 400 and "maximum context length" in detail.lower()
            else EngineUnavailable
        )
        raise error(f"HTTP {response.status_code} from {response.url}: {detail}")


def _half_prefix(ctx: CompletionContext) -> CompletionContext | None:
    """The context with the last half of its prefix, from a line start (None: nothing to cut)."""
    cut = ctx.prefix.find("\n", len(ctx.prefix) // 2)
    if cut == -1 or cut + 1 >= len(ctx.prefix):
        return None
    return replace(ctx, prefix=ctx.prefix[cut + 1 :], chunks=(), prefix_truncated=True)


def _error_text(payload) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or payload)[:200]
