"""The real language server with a probe: after every engine answer it sends the client a
`wdBench/answer` notification saying when the first token arrived and what the engine reported.

The probe wraps three methods and changes no behaviour: the server's code, settings and engine are
the ones editors get. The notification goes out before the completion's response, so the client
can pair it with its request by (uri, version). Times are `time.monotonic()`, a clock shared by
every process on the machine, so the client can subtract its keystroke times from them.

Run as `python -m wd_lsp.bench.probe_server` (stdio).
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time

from engine.ipc.client import CompletionStream
from wd_lsp.engine_link import EngineLink
from wd_lsp.server import WdLanguageServer, server
from wd_lsp.transport import serve_stdio

NOTIFICATION = "wdBench/answer"
_request: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "wd_bench_request", default=None
)

_deltas: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "wd_bench_deltas", default=None
)

_complete_at = WdLanguageServer._complete_at
_engine_complete = EngineLink.complete
_next_delta = CompletionStream.__anext__


async def _probed_complete_at(self, doc, offset, started, *args):
    _request.set({"uri": doc.uri, "version": doc.version, "offset": offset})
    return await _complete_at(self, doc, offset, started, *args)


async def _probed_next_delta(self):
    delta = await _next_delta(self)
    times = _deltas.get()
    if times is not None:
        times.append(time.monotonic())
    return delta


async def _probed_engine_complete(self, ctx, rules, key, **choices):
    submitted = time.monotonic()
    times: list[float] = []
    _deltas.set(times)  # the stream is read in this task: the deltas' arrival times
    answer = await _engine_complete(self, ctx, rules, key, **choices)
    info = dict(_request.get() or {})
    info.update(
        submittedAt=submitted,
        doneAt=time.monotonic(),
        firstTokenAt=None
        if answer.first_token_ms is None
        else submitted + answer.first_token_ms / 1000,
        usage=answer.usage,
        stoppedEarly=answer.stopped_early,
        chars=len(answer.text),
        # Decode speed even when a stop rule cut the stream (then the engine sends no usage):
        # the engine streams about one delta per token.
        deltas=len(times),
        decodeS=(times[-1] - times[0]) if len(times) > 1 else None,
    )
    try:
        server.protocol.notify(NOTIFICATION, info)
    except Exception:  # noqa: BLE001 - measuring must never break a completion
        pass
    return answer


WdLanguageServer._complete_at = _probed_complete_at
EngineLink.complete = _probed_engine_complete
CompletionStream.__anext__ = _probed_next_delta


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return serve_stdio(server)


if __name__ == "__main__":
    sys.exit(main())
