"""The server's side of the engine: connect (spawning the daemon if needed), complete with early
stop, warm, restart, and a state the status bar can show. A dead engine costs one logged error
and empty completions; the next request reconnects, which respawns it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from engine.client import CompletionStream, EngineClient, EngineError, EngineUnavailable, SpawnConfig
from engine.protocol import BAD_REQUEST

from .config import Settings
from .context import CompletionContext
from .shape import StopRules, apply_stop_rules

log = logging.getLogger(__name__)

RESTART_DELAY_S = 0.3
CLIENT_GRACE_S = 2.0  # beyond the request's own deadline, before the server gives up on the engine


@dataclass
class EngineAnswer:
    text: str
    stopped_early: bool  # a stop rule fired in the server and the engine was cancelled
    usage: dict | None
    first_token_ms: float | None


class EngineLink:
    def __init__(self, on_state: Callable[[str, str], None], on_progress: Callable[[str], None]):
        self.on_state = on_state  # (state, message): "starting" | "ready" | "error" | ...
        self.on_progress = on_progress
        self.client: EngineClient | None = None
        self.settings: Settings | None = None
        self.state = "idle"
        self.model_info: dict | None = None
        self._error_logged = False
        self._restart_task: asyncio.Task | None = None
        self._beams_refused = False  # the connected engine predates beam search

    def configure(self, settings: Settings) -> None:
        """New settings; a changed engine address or model takes effect at the next connect."""
        old = self.settings
        self.settings = settings
        if old is not None and (old.engine != settings.engine or old.model != settings.model) and self.client:
            self.client.disconnect()
            self.client = None

    def _make_client(self) -> EngineClient:
        s = self.settings
        if s.engine.tcp:
            host, _, port = s.engine.tcp.rpartition(":")
            return EngineClient(tcp=(host, int(port)), token=s.engine.token)
        spawn = SpawnConfig(model=s.model) if s.engine.auto_start else None
        return EngineClient(socket_path=s.engine.socket, spawn=spawn, on_progress=self.on_progress)

    async def ensure_connected(self) -> EngineClient:
        if self.client is None:
            self.client = self._make_client()
        if not self.client.connected:
            self._set_state("starting", "connecting to the engine")
            try:
                info = await self.client.connect()
            except (EngineUnavailable, EngineError, OSError) as exc:
                self._report_failure(exc)
                raise EngineUnavailable(str(exc)) from exc
            self.model_info = info.get("model")
            self._error_logged = False
            self._beams_refused = False
            self._set_state("ready", f"engine ready: {self.model_info.get('name') if self.model_info else '?'}")
        return self.client

    async def complete(self, ctx: CompletionContext, rules: StopRules, key: str) -> EngineAnswer:
        """Stream a completion, stopping the engine as soon as a stop rule fires."""
        s = self.settings
        params = dict(
            prefix=ctx.prefix, suffix=ctx.suffix, path=ctx.path,
            chunks=[{"path": c.path, "text": c.text} for c in ctx.chunks],
            max_tokens=s.max_tokens, temperature=float(s.temperature),
            stop=list(rules.stop_strings), client=key, deadline_ms=s.request_timeout_ms,
        )
        if not rules.multiline and s.beams > 1 and not self._beams_refused:  # a block streams as greedy writes it
            params["beams"] = s.beams
        try:
            return await self._complete(params, rules)
        except EngineError as exc:
            # A daemon started by an older wd-lsp (it stays resident) knows no beams: greedy
            # until the next connection.
            if not (exc.code == BAD_REQUEST and "beams" in exc.message and params.pop("beams", None)):
                raise
            self._beams_refused = True
            log.warning("the running engine does not take 'beams' (wdLsp.restartEngine updates it); decoding greedily")
            return await self._complete(params, rules)

    async def _complete(self, params: dict, rules: StopRules) -> EngineAnswer:
        s = self.settings
        client = await self.ensure_connected()
        started = time.monotonic()
        first_token_ms = None
        text, stopped = "", False
        stream: CompletionStream | None = None
        try:
            # The engine enforces the deadline itself; this bound covers an engine that hangs.
            async with asyncio.timeout(s.request_timeout_ms / 1000 + CLIENT_GRACE_S):
                stream = await client.complete(params)
                async for delta in stream:
                    if first_token_ms is None:
                        first_token_ms = 1000 * (time.monotonic() - started)
                    text += delta
                    kept, stopped = apply_stop_rules(text, rules)
                    if stopped:
                        text = kept
                        await stream.cancel()
                        break
        except asyncio.CancelledError:
            if stream is not None:
                await asyncio.shield(stream.cancel())
            raise
        except TimeoutError as exc:
            if stream is not None:
                await asyncio.shield(stream.cancel())
            log.error("the engine did not answer within %.1f s", s.request_timeout_ms / 1000 + CLIENT_GRACE_S)
            raise EngineError("timeout", "the engine did not answer in time") from exc
        except EngineUnavailable as exc:
            self._report_failure(exc)
            raise
        return EngineAnswer(text, stopped, stream.result, first_token_ms)

    async def warm(self, ctx: CompletionContext, key: str) -> None:
        client = await self.ensure_connected()
        await client.warm(dict(prefix=ctx.prefix, suffix=ctx.suffix, path=ctx.path,
                               chunks=[{"path": c.path, "text": c.text} for c in ctx.chunks],
                               client=key))

    async def stats(self) -> dict:
        if self.client is None or not self.client.connected:
            return {}
        return await self.client.request("stats")

    async def restart(self) -> None:
        """Stop the engine (it drains) and connect again, which starts a fresh one. An engine
        this server cannot start again (TCP, or autoStart off) is shared: only reconnect."""
        can_spawn = not self.settings.engine.tcp and self.settings.engine.auto_start
        if can_spawn and self.client is not None and self.client.connected:
            try:
                await self.client.request("shutdown")
            except (EngineUnavailable, EngineError):
                pass
            await self.client.close()
            await asyncio.sleep(0.2)
        elif self.client is not None:
            self.client.disconnect()
        self.client = None
        await self.ensure_connected()

    def disconnect(self) -> None:
        if self.client is not None:
            self.client.disconnect()
            self.client = None

    def _report_failure(self, exc: Exception) -> None:
        if not self._error_logged:
            log.error("engine unavailable: %s (completions are empty until it is back)", exc)
            self._error_logged = True
        if self.client is not None:
            self.client.disconnect()
            self.client = None
        self._set_state("error", f"engine unavailable: {exc}")
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.ensure_future(self._restart_soon())

    async def _restart_soon(self) -> None:
        """Bring a dead engine back without waiting for the next keystroke (once per failure)."""
        await asyncio.sleep(RESTART_DELAY_S)
        try:
            await self.ensure_connected()
        except (EngineUnavailable, EngineError, OSError):
            pass  # logged once already; the next request tries again

    def _set_state(self, state: str, message: str) -> None:
        self.state = state
        self.on_state(state, message)
