"""The server's side of the engine: connect (spawning the daemon if needed), complete with early
stop, warm, restart, and a state the status bar can show. A dead engine costs one logged error
and empty completions; the next request reconnects, which respawns it.

Every wait on the engine is bounded, so a stopped, hung or still-loading engine gives empty
completions and one logged reason, never a stalled editor: connecting (which may spawn the
engine and load its model) runs as one background task that callers wait for at most a request
timeout (once the engine is known to be loading, only briefly); a completion has its guard; a
cancel is sent and not waited for; warms, stats and the restart's shutdown have a bound. Only that
task connects (or spawns): requests go out on an existing connection or not at all. After a failed
spawn (something foreign at the socket path included) or an engine that stopped answering,
reconnecting waits a backoff that doubles up to a cap, while requests are answered at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.ipc.client import (
    CompletionStream,
    EngineClient,
    EngineError,
    EngineStarting,
    EngineTimeout,
    EngineUnavailable,
    SpawnConfig,
    SpawnFailed,
)
from engine.ipc.protocol import FEATURE_BEAMS, FEATURE_N, hello_features

from .config import Settings
from .context import CompletionContext, encodable
from .shape import StopRules, apply_stop_rules

log = logging.getLogger(__name__)

RESTART_DELAY_S = 0.3
# Beyond the request's own deadline (the engine keeps it) before giving up on it: the engine
# checks deadlines only between scheduler steps, and one prefill step on a loaded CPU can take
# a second or more.
CLIENT_GRACE_S = 2.0
# How long a request waits for an engine already known to be loading its model: the completion
# is empty either way, and clients that wait for it before showing their menu must not hang.
STARTING_WAIT_S = 0.15
STATS_TIMEOUT_S = (
    1.0  # wdLsp.status asks for the engine's stats: a stopped engine must not stall it
)
RESTART_WAIT_S = (
    30.0  # wdLsp.restartEngine waits this long for the new engine; it goes on loading after
)
BACKOFF_FIRST_S, BACKOFF_MAX_S = (
    1.0,
    60.0,
)  # before connecting again after a failed spawn or a silent engine


def _now() -> float:
    """The clock of the backoff (tests move it; time.monotonic also drives the event loop)."""
    return time.monotonic()


@dataclass
class EngineAnswer:
    text: str
    stopped_early: bool  # a stop rule fired in the server and the engine was cancelled
    usage: dict | None
    first_token_ms: float | None
    # Other completions the engine found (a beam search asked for n > 1), best first.
    alternatives: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sampling:
    """A sampled completion instead of the settings' decoding (an extra suggestion)."""

    temperature: float
    top_p: float
    seed: int


def _alternatives(result) -> tuple[str, ...]:
    """The `alternatives` of a `complete` result, nothing taken on trust."""
    found = result.get("alternatives") if isinstance(result, dict) else None
    if not isinstance(found, list):
        return ()
    return tuple(t for t in found if isinstance(t, str))


class EngineLink:
    def __init__(self, on_state: Callable[[str, str], None], on_progress: Callable[[str], None]):
        self.on_state = on_state  # (state, message): "starting" | "ready" | "error" | ...
        self.on_progress = on_progress
        self.client: EngineClient | None = None
        self.settings: Settings | None = None
        self.state = "idle"
        self.model_info: dict | None = None
        self._error_logged = False  # this failure has been told: quiet until the engine is back
        self._last_error: str | None = None
        # Why the engine could not be started (the first line of what it said as it exited: a
        # model that cannot load, or does not fit the GPU), until it is up again.
        self.start_error: str | None = None
        self._error_message: str | None = None  # the last error's, until the engine is ready
        self._starting_logged = False
        self._timeout_logged = False
        self._restart_task: asyncio.Task | None = None
        self._connect_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # cancels on their way to the engine
        self._progress_message: str | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0  # no new connect (nor spawn) before this, in _now()
        # What the connected engine's hello lists (engine.ipc.protocol.FEATURES).
        self.engine_features: frozenset[str] = frozenset()

    def configure(self, settings: Settings) -> None:
        """New settings; a changed engine address or model takes effect at the next connect."""
        old = self.settings
        self.settings = settings
        if old is not None and (old.engine != settings.engine or old.model != settings.model):
            self.disconnect()
            self._reset_backoff()  # new settings: a new chance at once

    def _make_client(self) -> EngineClient:
        s = self.settings
        if s.engine.tcp:
            host, _, port = s.engine.tcp.rpartition(":")
            return EngineClient(tcp=(host, int(port)), token=s.engine.token)
        spawn = SpawnConfig(model=s.model) if s.engine.auto_start else None
        return EngineClient(socket_path=s.engine.socket, spawn=spawn, on_progress=self._progress)

    def _progress(self, message: str) -> None:
        """Spawn progress (from the spawning thread): shown, and kept as the reason a completion
        that cannot wait for the engine is empty."""
        self._progress_message = message
        self.on_progress(message)

    async def ensure_connected(self, wait_s: float | None = None) -> EngineClient:
        """The connected client. Connecting (and spawning, and loading the model) is one task
        shared by all callers, which wait for it at most `wait_s` (default: the request timeout,
        or STARTING_WAIT_S once the engine is known to be loading) and then get EngineStarting
        while the engine goes on starting; a later call finds it."""
        client = self.client
        if client is not None and client.connected:
            return client
        task = self._connect_task
        if task is None or task.done():
            self._check_backoff()
            task = self._connect_task = asyncio.ensure_future(self._connect())
            task.add_done_callback(_consume_outcome)
        wait = self._connect_wait() if wait_s is None else wait_s
        try:
            async with asyncio.timeout(wait):
                return await asyncio.shield(task)
        except TimeoutError:
            raise self._still_starting(wait) from None
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():
                raise EngineUnavailable("the connection attempt was replaced") from None
            raise

    def _connect_wait(self) -> float:
        """The first request waits the request timeout (a fast-loading model then answers it);
        once that was not enough, requests only glance at the loading engine."""
        timeout_s = self.settings.request_timeout_ms / 1000
        return min(timeout_s, STARTING_WAIT_S) if self._starting_logged else timeout_s

    async def _connect(self) -> EngineClient:
        """The shared connect task: the only place that connects, and so spawns, the engine."""
        if self.client is None:
            self.client = self._make_client()
        client = self.client
        self._progress_message = None
        if not self._error_logged:  # a retry during a failure stays quiet
            self._set_state("starting", "connecting to the engine")
        try:
            info = await client.connect()
        except EngineUnavailable as exc:
            self._report_failure(exc, client)
            raise
        except (EngineError, OSError) as exc:  # refused hello (version, token), a socket error
            self._report_failure(exc, client)
            raise EngineUnavailable(str(exc)) from exc
        if client is not self.client:  # restarted or reconfigured meanwhile
            client.disconnect()
            raise EngineUnavailable("the engine settings changed while connecting")
        self.model_info = info.get("model")
        self._error_logged = self._starting_logged = self._timeout_logged = False
        self._last_error = self.start_error = None
        self._reset_backoff()
        # The only place that connects: the features of the engine every request goes to.
        self.engine_features = hello_features(info)
        if self.settings.beams > 1 and FEATURE_BEAMS not in self.engine_features:
            log.warning(
                "the running engine does not take 'beams' (wdLsp.restartEngine updates it); "
                "decoding greedily"
            )
        self._set_state(
            "ready", f"engine ready: {self.model_info.get('name') if self.model_info else '?'}"
        )
        return client

    def _still_starting(self, waited_s: float) -> EngineStarting:
        """The engine is not up yet: this request is answered empty, said once per start."""
        # "loading the model (12 s)" is said once: without a count that is stale by then
        reason = re.sub(r" \(\d+ s\)$", "", self._progress_message or "the engine is starting")
        if not self._starting_logged:
            self._starting_logged = True
            self._set_state("starting", f"{reason}; completions are empty until it is ready")
        return EngineStarting(f"{reason} (waited {waited_s:.1f} s)")

    def _check_backoff(self) -> None:
        remaining = self._retry_at - _now()
        if remaining > 0:
            raise EngineUnavailable(f"{self._last_error}; not trying again for {remaining:.0f} s")

    def _back_off(self) -> None:
        self._backoff_s = (
            min(BACKOFF_MAX_S, 2 * self._backoff_s) if self._backoff_s else BACKOFF_FIRST_S
        )
        self._retry_at = _now() + self._backoff_s

    def _reset_backoff(self) -> None:
        self._backoff_s, self._retry_at = 0.0, 0.0

    async def complete(
        self,
        ctx: CompletionContext,
        rules: StopRules,
        key: str,
        n: int = 1,
        sampling: Sampling | None = None,
    ) -> EngineAnswer:
        """Stream a completion, stopping the engine as soon as a stop rule fires. `n` > 1 asks
        for up to n - 1 alternatives (a beam search finds them); `sampling` samples instead of
        the settings' decoding."""
        s = self.settings
        params = dict(
            prefix=ctx.prefix,
            suffix=ctx.suffix,
            path=ctx.path,
            chunks=[{"path": c.path, "text": c.text} for c in ctx.chunks],
            max_tokens=s.max_tokens,
            temperature=float(s.temperature),
            stop=list(rules.stop_strings),
            client=encodable(key),
            deadline_ms=s.request_timeout_ms,
        )
        if sampling is not None:
            params.update(
                temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed
            )
            return await self._complete(params, rules, beams=1)
        # A block streams as greedy writes it: beams only for a single line.
        return await self._complete(params, rules, beams=1 if rules.multiline else s.beams, n=n)

    async def _complete(
        self, params: dict, rules: StopRules, beams: int, n: int = 1
    ) -> EngineAnswer:
        s = self.settings
        client = await self.ensure_connected()
        # Only an engine that says it takes beams gets them: a daemon started by an older wd-lsp
        # stays resident and refuses the parameter.
        if beams > 1 and FEATURE_BEAMS in self.engine_features:
            params["beams"] = beams
            if n > 1 and FEATURE_N in self.engine_features:
                params["n"] = n
        guard_s = s.request_timeout_ms / 1000 + CLIENT_GRACE_S
        started = time.monotonic()
        first_token_ms = None
        text, stopped = "", False
        stream: CompletionStream | None = None
        try:
            # The engine enforces the deadline itself; this bound covers an engine that hangs.
            async with asyncio.timeout(guard_s):
                stream = await client.complete(params, reconnect=False)
                async for delta in stream:
                    if first_token_ms is None:
                        first_token_ms = 1000 * (time.monotonic() - started)
                    text += delta
                    kept, stopped = apply_stop_rules(text, rules)
                    if stopped:
                        text = kept
                        self._cancel_soon(stream)
                        break
        except asyncio.CancelledError:
            if stream is not None:
                self._cancel_soon(stream)
            raise
        except TimeoutError as exc:
            if stream is not None:
                self._cancel_soon(stream)
            raise self._timed_out(guard_s) from exc
        except EngineUnavailable as exc:
            if not self._connecting():  # otherwise that connect already brings the engine back
                self._report_failure(exc, client)
            raise
        if self._timeout_logged:
            self._timeout_logged = False
            self._set_state("ready", "the engine answers again")
        return EngineAnswer(
            text, stopped, stream.result, first_token_ms, _alternatives(stream.result)
        )

    def _cancel_soon(self, stream: CompletionStream) -> None:
        """Tell the engine to stop, without waiting for it: a stopped engine never acknowledges,
        and the cancel bounds its own wait."""
        task = asyncio.ensure_future(stream.cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _timed_out(self, guard_s: float) -> EngineTimeout:
        """A connected engine that did not answer (stopped, hung): said once until it answers."""
        message = f"the engine did not answer within {guard_s:.1f} s (stopped or hung?)"
        if not self._timeout_logged:
            self._timeout_logged = True
            log.error("%s; completions are empty until it answers", message)
            self._set_state("error", f"{message}; completions are empty until it answers")
        return EngineTimeout(message)

    async def warm(self, ctx: CompletionContext, key: str) -> None:
        """Prefill the prompt at the cursor; EngineTimeout after the request timeout."""
        client = await self.ensure_connected()
        params = dict(
            prefix=ctx.prefix,
            suffix=ctx.suffix,
            path=ctx.path,
            chunks=[{"path": c.path, "text": c.text} for c in ctx.chunks],
            client=encodable(key),
        )
        await client.warm(params, timeout=self.settings.request_timeout_ms / 1000, reconnect=False)

    async def stats(self) -> dict:
        """The engine's counters ({} when not connected), or EngineTimeout after STATS_TIMEOUT_S."""
        client = self.client
        if client is None or not client.connected:
            return {}
        return await client.request("stats", timeout=STATS_TIMEOUT_S, reconnect=False)

    async def restart(self) -> None:
        """Stop the engine (it drains) and connect again, which starts a fresh one. An engine
        this server cannot start again (TCP, or autoStart off) is shared: only reconnect."""
        can_spawn = not self.settings.engine.tcp and self.settings.engine.auto_start
        client = self.client
        if can_spawn and client is not None and client.connected:
            try:
                await client.request("shutdown", timeout=STATS_TIMEOUT_S, reconnect=False)
            except (EngineUnavailable, EngineError):
                pass
            await client.close()
            await asyncio.sleep(0.2)
        self.disconnect()
        self._reset_backoff()  # asked for: try at once
        await self.ensure_connected(wait_s=RESTART_WAIT_S)

    def disconnect(self) -> None:
        """Drop the connection and all that would use or bring back the engine after it: a connect
        in progress (a spawn already under way goes on in its thread: its engine serves the next
        connect), a scheduled reconnect, and cancels still on their way (the engine drops the work
        of a closed connection)."""
        tasks = [self._connect_task, self._restart_task, *self._background]
        self._connect_task = self._restart_task = None
        current = _current_task()
        for task in tasks:
            if task is not None and task is not current and not task.done():
                task.cancel()
        if self.client is not None:
            self.client.disconnect()
            self.client = None

    def _connecting(self) -> bool:
        return self._connect_task is not None and not self._connect_task.done()

    def _report_failure(self, exc: Exception, client: EngineClient) -> None:
        """Drop `client`'s connection, say why once per failure (a new reason is said too), and
        retry soon; after a failed spawn or an engine that does not answer, only after a backoff.
        A client the link has already replaced is none of its business any more."""
        if client is not self.client:
            return
        if isinstance(exc, (SpawnFailed, EngineTimeout)):
            self._back_off()
        self.start_error = _start_failure(exc)
        if not self._error_logged or str(exc) != self._last_error:
            log.error("engine unavailable: %s (completions are empty until it is back)", exc)
            self._error_logged = True
            self._last_error = str(exc)
            self._set_state("error", f"engine unavailable: {exc}")
        self._starting_logged = False
        client.disconnect()
        self.client = None
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.ensure_future(self._restart_soon())

    async def _restart_soon(self) -> None:
        """Bring a dead engine back without waiting for the next keystroke (once per failure)."""
        await asyncio.sleep(max(RESTART_DELAY_S, self._retry_at - _now()))
        try:
            await self.ensure_connected()
        except (EngineUnavailable, EngineError, OSError):
            pass  # logged once already; the next request tries again

    @property
    def error(self) -> str | None:
        """Why the engine is unavailable, until it is back (also while it is being started
        again): a failed start's own reason, else the last error's message."""
        return self.start_error or self._error_message

    def _set_state(self, state: str, message: str) -> None:
        self.state = state
        if state in ("error", "ready"):
            self._error_message = message if state == "error" else None
        self.on_state(state, message)


def _start_failure(exc: Exception) -> str | None:
    """The first line of why a start failed (the engine's own words where it said them), None
    for failures of an engine that had started."""
    if not isinstance(exc, SpawnFailed):
        return None
    reason = getattr(exc, "reason", None) or str(exc)
    return reason.strip().split("\n", 1)[0] or None


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (a process that is exiting)
        return None


def _consume_outcome(task: asyncio.Task) -> None:
    """A connect nobody waited for to the end: its failure was reported, not to be raised again."""
    if not task.cancelled():
        task.exception()
