"""Request bodies (checked by pydantic), response bodies and the error JSON, in OpenAI's shapes.

Types are strict (a string where a number belongs is refused, as OpenAI does); fields OpenAI (or vLLM) defines
that would change the answer and that the engine does not implement are refused by name (``n`` > 1, ``logprobs``,
``frequency_penalty``, ``logit_bias``, ``tools``, ... :data:`UNSERVED`) unless unset, null or at their neutral
value (what the official client sends is only what the caller set); other unknown fields (``user``,
``metadata``, ...) change nothing and are ignored, as clients send many. Every sampling field is checked here, against the limits of ``inference.serve.limits``: a value the
engine cannot serve is a 400 naming the field, never an engine failure. Extra fields: ``top_k`` (0 or -1 = off), ``return_token_ids`` (each choice and chunk carries its
token ids), and ``usage.speculative`` (target forwards, drafted and accepted tokens, τ).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from inference.algorithms.base import GenerationStats
from inference.serve.limits import MAX_SEED, MAX_STOP_CHARS, MAX_STOPS, MIN_TEMPERATURE


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TOOLS = "tool and function calling"
# field -> (its neutral values, what is not served): set to anything else, a request is refused naming the field
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((0,), "a frequency penalty"),
    "presence_penalty": ((0,), "a presence penalty"),
    "repetition_penalty": ((1,), "a repetition penalty"),
    "logit_bias": (({},), "a logit bias"),
    "min_p": ((0,), "min_p filtering (top_k and top_p are)"),
    "min_tokens": ((0,), "a minimum length"),
    "ignore_eos": ((False,), "ignoring EOS"),
    "top_logprobs": ((0,), "logprobs"),
    "best_of": ((1,), "best_of"),
    "suffix": (("",), "insertion (a suffix)"),
    "response_format": (({"type": "text"},), "structured output"),
    "tools": (([],), _TOOLS),
    "tool_choice": (("none",), _TOOLS),
    "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS),
    "prediction": ((), "a predicted output"),
    "audio": ((), "audio output"),
    "modalities": ((["text"],), "output other than text"),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(
        type(value) is not bool and value == n if type(n) is not bool else value is n for n in neutral
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The sampling and length fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the server's setting (its temperature=, top_k=, top_p=; temperature 1.0 unless set)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # 0 (greedy) or MIN_TEMPERATURE..2
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    stop: str | list[str] | None = None  # at most MAX_STOPS strings of at most MAX_STOP_CHARS characters
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = 1
    logprobs: bool | int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unserved_fields_unset(cls, data: Any) -> Any:
        for name, (neutral, what) in UNSERVED.items():
            if isinstance(data, dict) and name in data and not _neutral(data[name], neutral):
                shown = "null" + "".join(f" or {n!r}" for n in neutral) if neutral else "null"
                raise PydanticCustomError(
                    "unserved", f"{what} is not served; leave it unset ({shown})", {"param": name}
                )
        return data

    @model_validator(mode="after")
    def _no_sampling_fields_when_greedy(self) -> GenerationRequest:
        """A request that asks for temperature 0 gets the argmax, which every top-k and top-p keeps, and draws
        nothing: a filter set on, or a seed, would do nothing (with no temperature of its own, the server's
        default decides, which the client may not know: nothing is refused then)."""
        if self.temperature != 0:
            return self
        for name, on in (
            ("top_k", self.top_k not in (None, 0, -1)),
            ("top_p", self.top_p not in (None, 1)),
            ("seed", self.seed is not None),
        ):
            if on:
                raise PydanticCustomError(
                    "greedy",
                    f"{name} does nothing at temperature=0 (greedy: the argmax, "
                    f"nothing drawn); set temperature > 0 to sample, or leave {name} unset",
                    {"param": name},
                )
        return self

    @field_validator("temperature")
    @classmethod
    def _greedy_or_at_least_the_minimum(cls, temperature):
        if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}; use 0 for greedy decoding"
            )
        return temperature

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return stop

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise ValueError("only n=1 is served; send one request per choice")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs):
        if logprobs:
            raise ValueError("logprobs are not served; leave logprobs unset")
        return logprobs

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = Field(min_length=1)  # text, or token ids
    echo: Literal[False] = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def turn(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(prompt_tokens: int, completion_tokens: int, stats: GenerationStats, algorithm: str) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculative": {
            "algorithm": algorithm,
            "target_forwards": stats.target_forwards,
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_draft_tokens,
            "tau": round(stats.tau, 4),
        },
    }


class ResponseShape:
    """Builds the bodies of one answer, for ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions``."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool):
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def _choice(
        self, text: str | None, token_ids: list[int] | None, finish_reason: str | None, delta: bool
    ) -> dict[str, Any]:
        if self.chat:
            content = (
                {"role": "assistant", "content": text} if not delta else ({} if text is None else {"content": text})
            )
            choice = {
                "index": 0,
                "delta" if delta else "message": content,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def full(self, text: str, token_ids: list[int], finish_reason: str, usage: dict) -> dict[str, Any]:
        return self._envelope(
            "chat.completion" if self.chat else "text_completion",
            [self._choice(text, token_ids, finish_reason, delta=False)],
            usage,
        )

    def chunk(
        self, text: str | None, token_ids: list[int] | None = None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        return self._envelope(
            "chat.completion.chunk" if self.chat else "text_completion",
            [self._choice(text, token_ids, finish_reason, delta=True)],
        )

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant role, no content yet."""
        return self._envelope(
            "chat.completion.chunk",
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        )

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
