"""The server's JSON-RPC protocol: pygls' LSP protocol with the text-sync handlers replaced, an
answer for every request, and the spec's exit code.

pygls keeps its own copy of every open document and, before our `didChange` handler runs,
converts `position.character` inside the shared params object to its own units and splits
lines with `str.splitlines` (form feed, U+2028 and friends count as line breaks there, not in
LSP). The server owns its text model (`wd_lsp.document`), so these handlers hand the client's
params to ours untouched and pygls' workspace never sees the documents.

pygls decodes a message inside its reader and only logs what fails there, so a client whose
request has bad params, or comes after `shutdown`, waits forever. `receive_body` (fed by
`wd_lsp.transport`) decodes a body itself and answers each such request with the JSON-RPC error
the spec names. pygls' `exit` ends the process through its own reader loop; here `exit` records
the spec's code and hands it to the transport (`wd_lsp.transport`), which returns it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from cattrs import transform_error
from lsprotocol import types
from pygls.exceptions import (
    JsonRpcException,
    JsonRpcInvalidParams,
    JsonRpcInvalidRequest,
    JsonRpcParseError,
)
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.json_rpc import (
    JsonRPCNotification,
    JsonRPCRequestMessage,
    JsonRPCResponseMessage,
)
from pygls.protocol.language_server import lsp_method

log = logging.getLogger(__name__)
_DETAIL_CHARS = 300  # of a decoding error, in a response or a log line


def _to_our_handler(method: str):
    """A builtin for a text-sync notification that hands the params, untouched, to our handler."""

    @lsp_method(method)
    def builtin(self, params):
        if (handler := self._user_handler(method)) is not None:
            yield handler, (params,), None

    return builtin


class WdProtocol(LanguageServerProtocol):
    exit_code: int | None = None  # set by `exit`
    on_exit: Callable[[int], None] | None = None  # the transport's stop, given the exit code

    def _user_handler(self, method: str):
        return self.fm.features.get(method)

    lsp_text_document__did_open = _to_our_handler(types.TEXT_DOCUMENT_DID_OPEN)
    lsp_text_document__did_change = _to_our_handler(types.TEXT_DOCUMENT_DID_CHANGE)
    lsp_text_document__did_close = _to_our_handler(types.TEXT_DOCUMENT_DID_CLOSE)

    # -- lifecycle -------------------------------------------------------------------------------
    def lifecycle_exit_code(self) -> int:
        """The spec's exit code: 0 when `shutdown` came first, 1 otherwise."""
        return 0 if self._shutdown else 1

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args):
        if (handler := self._user_handler(types.EXIT)) is not None:
            yield handler, args, None
        self.exit_code = self.lifecycle_exit_code()
        log.info("exit (code %d)", self.exit_code)
        if self.on_exit is not None:
            self.on_exit(self.exit_code)

    def _refused_after_shutdown(self, data: dict) -> bool:
        """After `shutdown` only `exit` is handled: a request gets an error, the rest is dropped."""
        method = data.get("method")
        if not self._shutdown or method == types.EXIT:
            return False
        if method is None:
            log.debug("a response after shutdown: ignored")
        elif "id" in data:
            log.warning("request %r after shutdown: refused", method)
            error = JsonRpcInvalidRequest(message=f"{method}: the server is shutting down")
            self._send_error(data["id"], error)
        else:
            log.warning("notification %r after shutdown: ignored", method)
        return True

    # -- decoding --------------------------------------------------------------------------------
    def receive_body(self, body: bytes) -> None:
        """Decode and handle one message body, answering a request that cannot be handled."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, or nested too deep
            log.warning(
                "a message is not valid JSON (%s): answered with a parse error", _brief(exc)
            )
            self._send_error(None, JsonRpcParseError(message=f"Parse error: {_brief(exc)}"))
            return
        if (problem := _envelope_problem(data)) is not None:
            msg_id = (
                data.get("id")
                if isinstance(data, dict) and _is_request_id(data.get("id"))
                else None
            )
            log.warning("an invalid JSON-RPC message (%s): answered with an error", problem)
            self._send_error(msg_id, JsonRpcInvalidRequest(message=f"Invalid request: {problem}"))
            return
        if self._refused_after_shutdown(data):
            return
        try:
            message = self._structure(data)
        except Exception as exc:  # noqa: BLE001 - cattrs' validation errors and whatever else it raises
            self._reject_content(data, exc)
            return
        self.handle_message(message)

    def _structure(self, data: dict) -> Any:
        """The typed message, as pygls' `structure_message` builds it, for an envelope already
        checked."""
        if (method := data.get("method")) is not None:
            fallback = JsonRPCRequestMessage if "id" in data else JsonRPCNotification
            return self._converter.structure(data, self.get_message_type(method) or fallback)
        if "error" in data:
            return self._converter.structure(data, types.ResponseErrorMessage)
        result_type = self._result_types.pop(data["id"], None) or JsonRPCResponseMessage
        return self._converter.structure(data, result_type)

    def _reject_content(self, data: dict, exc: Exception) -> None:
        try:
            detail = "; ".join(transform_error(exc))
        except Exception:  # noqa: BLE001 - only a description
            detail = str(exc)
        detail = detail[:_DETAIL_CHARS]
        method = data.get("method")
        if method is not None and "id" in data:
            log.warning(
                "request %r has invalid params (%s): answered with an error", method, detail
            )
            error = JsonRpcInvalidParams(message=f"Invalid params for {method}: {detail}")
            self._send_error(data["id"], error)
        else:
            log.warning(
                "dropped a %s with invalid content: %s",
                f"{method!r} notification" if method else "response",
                detail,
            )

    def _send_error(self, msg_id: int | str | None, error: JsonRpcException) -> None:
        # A plain dict: lsprotocol's converter leaves out `"id": null`, which JSON-RPC requires
        # here.
        self._send_data(
            {
                "jsonrpc": self.VERSION,
                "id": msg_id,
                "error": {"code": error.code, "message": error.message},
            }
        )


def _is_request_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _envelope_problem(data: Any) -> str | None:
    """What makes `data` no JSON-RPC 2.0 request, notification or response; None if nothing."""
    if not isinstance(data, dict):
        return "not a JSON object (LSP has no batches)"
    if data.get("jsonrpc") != "2.0":
        return 'no "jsonrpc": "2.0"'
    if "method" in data:
        if not isinstance(data["method"], str):
            return "the method is not a string"
        if "id" in data and not _is_request_id(data["id"]):
            return "the id is neither an integer nor a string"
        if not isinstance(data.get("params"), (dict, list, type(None))):
            return "params are neither an object nor an array"
        return None
    if "id" not in data or ("result" in data) == ("error" in data):
        return "neither a request, a notification nor a response"
    if data["id"] is not None and not _is_request_id(data["id"]):
        return "the id is neither an integer nor a string"
    return None


def _brief(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:_DETAIL_CHARS]
