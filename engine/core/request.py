"""What goes into the engine and what comes out: a request, its events, and the typed refusals whose
`ErrorCode` every front (the daemon, the OpenAI endpoint, `wd-engine generate`) reports as is."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from engine.ipc.protocol import ErrorCode


class RequestRefused(RuntimeError):
    """A request the engine can never run; `code` is the error code its event carries."""

    code: ErrorCode = ErrorCode.ENGINE_ERROR

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class EmptyPrompt(RequestRefused):
    """A request without a prompt token: there is nothing to continue."""

    code = ErrorCode.BAD_REQUEST


class ContextExceeded(RequestRefused):
    """A prompt the model's context cannot hold together with at least one new token."""

    code = ErrorCode.CONTEXT_EXCEEDED


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
    if prompt_tokens >= context_length:
        raise ContextExceeded(
            f"the prompt has {prompt_tokens} tokens; the model's context is {context_length}, "
            "which must also hold a new token"
        )
    if max_tokens is not None and prompt_tokens + max_tokens > context_length:
        raise ContextExceeded(
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{prompt_tokens} and max_tokens asks for {max_tokens}"
        )


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
