"""What goes into the engine and what comes out: a request, its events, a one-shot caller's
gathered `Completion`, the typed refusals whose `ErrorCode` every front (the daemon, the OpenAI
endpoint, `wd-engine generate`) reports as is, and the checks and token budget of a request."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from engine.ipc.protocol import MAX_BEAMS, MAX_COMPLETIONS, ErrorCode


class RequestRefused(RuntimeError):
    """A request the engine can never run; `code` is the error code its event carries, `param`
    the request parameter at fault where there is one (the OpenAI endpoint reports it)."""

    code: ErrorCode = ErrorCode.ENGINE_ERROR
    param: str | None = None

    def __init__(self, message: str, code: ErrorCode | None = None, param: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param


class BadRequest(RequestRefused):
    """A request whose parameters make no sense to the engine."""

    code = ErrorCode.BAD_REQUEST


class EmptyPrompt(BadRequest):
    """A request without a prompt token: there is nothing to continue."""

    param = "prompt"


class ContextExceeded(RequestRefused):
    """A prompt the model's context cannot hold together with at least one new token (or, where
    the request asks for it, its whole max_tokens: then `param` is "max_tokens")."""

    code = ErrorCode.CONTEXT_EXCEEDED
    param = "prompt"


class PoolFull(RequestRefused):
    """A request that can never fit in the KV pool, even with every other request gone."""

    code = ErrorCode.POOL_FULL


def check_prompt(prompt_tokens: int, context_length: int, max_tokens: int | None = None) -> None:
    """Refuse a prompt that is empty or leaves no room for a new token in the model's context.

    Without `max_tokens` a budget past the room left is no error: generation stops at the
    context's end (finish reason "length"), as the daemon's completions do. With it, the prompt and
    the whole budget must fit: the OpenAI contract, where a request is refused rather than cut."""
    if prompt_tokens <= 0:
        raise EmptyPrompt("the prompt is empty")
    # The whole budget first: OpenAI clients trim their prompt on "maximum context length".
    if max_tokens is not None and prompt_tokens + max_tokens > context_length:
        raise ContextExceeded(
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{prompt_tokens} and max_tokens asks for {max_tokens}",
            param="max_tokens",
        )
    if prompt_tokens >= context_length:
        raise ContextExceeded(
            f"the prompt has {prompt_tokens} tokens; the model's context is {context_length}, "
            "which must also hold a new token"
        )


def check_request(request: Request, context_length: int) -> None:
    """Refuse what the engine can never run, whatever the pool holds: the prompt's checks, a
    beam width outside what one lean forward takes, and more completions than one answer holds."""
    check_prompt(len(request.prompt_ids), context_length)
    if not 1 <= request.beams <= MAX_BEAMS:
        raise BadRequest(f"beams must be within 1..{MAX_BEAMS}, got {request.beams}")
    if not 1 <= request.n <= MAX_COMPLETIONS:
        raise BadRequest(f"n must be within 1..{MAX_COMPLETIONS}, got {request.n}")


@dataclass(frozen=True)
class TokenBudget:
    """The tokens a request's KV blocks must hold: its prompt, room for the tokens that write the
    forced text (at most one per byte), and the completion's own budget, all within the model's
    context."""

    prompt: int
    forced: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.forced + self.completion


def token_budget(request: Request, context_length: int) -> TokenBudget:
    """A warm-up only prefills; a completion gets the forced text's room first, then up to its
    `max_tokens` of what the context leaves (finishing with "length" where that is less)."""
    prompt = len(request.prompt_ids)
    if request.warm_only:
        return TokenBudget(prompt, 0, 0)
    forced = max(min(len(request.forced_text.encode()), context_length - prompt), 0)
    completion = max(min(request.max_tokens, context_length - prompt - forced), 0)
    return TokenBudget(prompt, forced, completion)


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    warm_only: bool = False  # prefill and keep the blocks cached; no output
    client: str | None = None  # a newer request of the same client supersedes older ones
    owner: str | None = None  # whom the engine shares fairly with others (a connection)
    deadline_s: float | None = None  # seconds after submission; then it ends with what it has
    return_logits: bool = False  # the first sampled position's logits in the final event
    forced_text: str = ""  # the first tokens must write this, and it is not released (healing)
    beams: int = 1  # > 1: beam search where greedy and the lean CPU path apply
    # Completions wanted: with a beam search, up to n - 1 alternatives come in the final event.
    n: int = 1
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Event:
    request_id: str
    kind: str  # "delta", "done" or "error"
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    logits: torch.Tensor | None = None
    code: ErrorCode | None = None  # an error's code
    token_ids: list[int] | None = None  # done: the tokens that wrote the forced text, then the rest
    # done: other completions' texts, best first, distinct from the text and each other (n > 1)
    alternatives: list[str] | None = None


class RequestFailed(RuntimeError):
    """A one-shot request that ended in an error event; `code` is the event's."""

    def __init__(self, message: str, code: ErrorCode | None):
        super().__init__(message)
        self.code = code


@dataclass
class Completion:
    """A request's events gathered, for a caller that waits for the whole answer
    (`Engine.complete`): its text, how it ended and its usage, or its error."""

    request_id: str
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    token_ids: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    error: str | None = None
    code: ErrorCode | None = None
    alternatives: list[str] = field(default_factory=list)

    def add(self, event: Event) -> None:
        if event.kind == "delta":
            self.text += event.text
        elif event.kind == "done":
            self.finish_reason, self.usage, self.logits = (
                event.finish_reason,
                event.usage,
                event.logits,
            )
            self.token_ids = list(event.token_ids or ())
            self.alternatives = list(event.alternatives or ())
        else:
            self.error, self.code = event.error, event.code

    def check(self) -> Completion:
        """Itself, or RequestFailed where the request ended in an error."""
        if self.error is not None:
            raise RequestFailed(self.error, self.code)
        return self

    @property
    def completion_tokens(self) -> int:
        """Tokens generated after the forced text."""
        return self.usage["completion_tokens"] if self.usage else 0

    @property
    def forced_tokens(self) -> int:
        """Tokens that wrote the forced text (engine.decoding.token_healing)."""
        return len(self.token_ids) - self.completion_tokens
