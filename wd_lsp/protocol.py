"""The server's JSON-RPC protocol: pygls' LSP protocol with the text-sync handlers replaced.

pygls keeps its own copy of every open document and, before our `didChange` handler runs,
converts `position.character` inside the shared params object to its own units and splits
lines with `str.splitlines` (form feed, U+2028 and friends count as line breaks there, not in
LSP). The server owns its text model (`wd_lsp.document`), so these handlers hand the client's
params to ours untouched and pygls' workspace never sees the documents.
"""

from __future__ import annotations

from lsprotocol import types
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method


class WdProtocol(LanguageServerProtocol):
    def _user_handler(self, method: str):
        return self.fm.features.get(method)

    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams):
        if (handler := self._user_handler(types.TEXT_DOCUMENT_DID_OPEN)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams):
        if (handler := self._user_handler(types.TEXT_DOCUMENT_DID_CHANGE)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams):
        if (handler := self._user_handler(types.TEXT_DOCUMENT_DID_CLOSE)) is not None:
            yield handler, (params,), None
