"""The OpenAI API's request bodies, checked strictly: an unknown field, a wrong type or a value
out of range is a 400 in the API's error shape, naming the field (pydantic does the checking).

Fields the API defines that this server does not implement (logit bias, tools, best_of > 1) are refused with a 400 that says so, rather than silently ignored. Log-probabilities
are the model's own (the raw logits' log-softmax, before temperature, top-k or top-p), as vLLM
reports them.
`top_k`, `min_p`, `repetition_penalty` and `ignore_eos` are extensions (as vLLM's).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the served model's default (its generation_config.json, as vLLM's --generation-config auto),
    # else the API's: temperature 1, top_p 1, top_k 0 (off) (inference.sampling_defaults)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # (vLLM's extensions, as top_k)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=0)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # OpenAI's penalties on the tokens generated so far: logit - frequency x count - presence x (count > 0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # defined by the API, not implemented here: refused unless left at its default
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field this server does not implement, set to something else than its default."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server"
        return None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


MAX_LOGPROBS = 20


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only (evaluation harnesses)
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None

    def unsupported(self):
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this server"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens = 0 returns nothing without echo = true (which scores the prompt)"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported by this server"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    response_format: dict | None = None

    def unsupported(self):
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs = true"
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools", "tools (function calling) are not supported by this server"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "response_format other than text is not supported by this server"
        return super().unsupported()


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # (vLLM's default: the ids a completion of this prompt reads)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The API's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
