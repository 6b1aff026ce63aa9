"""The engine's start-up as LSP work-done progress (`$/progress`), for clients that declare
`window.workDoneProgress`.

Each start is one progress: `window/workDoneProgress/create` with a fresh token, then `begin`
with the first message, a `report` per later message, and `end` once the engine is ready or has
failed. As the spec asks, nothing is sent with a token before the client has answered its create
request: messages are held until then and sent in order; a client that refuses the create gets
none of them. A new start after an end is a new progress with a new token.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lsprotocol import types as T

log = logging.getLogger(__name__)

TITLE = "wd-lsp engine"


class _Run:
    def __init__(self, token: str):
        self.token = token
        self.created = False
        self.refused = False
        self.pending: list[Any] = []


class EngineProgress:
    def __init__(
        self,
        send_request: Callable[[str, Any], Future],
        notify: Callable[[str, Any], None],
    ):
        self._send_request = send_request
        self._notify = notify
        self.supported = False  # the client declared window.workDoneProgress
        self._run: _Run | None = None

    @property
    def active(self) -> bool:
        return self._run is not None

    def report(self, message: str) -> None:
        """Begin a progress with `message`, or report it in the one under way."""
        if not self.supported:
            return
        run = self._run
        if run is None:
            run = self._run = _Run(f"wd-lsp-engine-{uuid.uuid4().hex[:8]}")
            run.pending.append(T.WorkDoneProgressBegin(title=TITLE, message=message))
            try:
                future = self._send_request(
                    T.WINDOW_WORK_DONE_PROGRESS_CREATE, T.WorkDoneProgressCreateParams(run.token)
                )
            except Exception:  # noqa: BLE001 - progress is a courtesy
                log.debug("could not ask for a progress token", exc_info=True)
                run.refused = True
                return
            future.add_done_callback(lambda f, run=run: self._created(run, f))
        else:
            self._send(run, T.WorkDoneProgressReport(message=message))

    def end(self, message: str) -> None:
        """End the progress under way, if any."""
        run, self._run = self._run, None
        if run is not None:
            self._send(run, T.WorkDoneProgressEnd(message=message))

    def _send(self, run: _Run, value: Any) -> None:
        if run.refused:
            return
        if not run.created:
            run.pending.append(value)
            return
        try:
            self._notify(T.PROGRESS, T.ProgressParams(token=run.token, value=value))
        except Exception:  # noqa: BLE001 - no client to tell any more
            log.debug("could not send progress", exc_info=True)

    def _created(self, run: _Run, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            log.debug("the client refused a progress token: no start-up progress")
            run.refused = True  # the rest of this start is not shown either
            run.pending.clear()
            return
        run.created = True
        pending, run.pending = run.pending, []
        for value in pending:
            self._send(run, value)
