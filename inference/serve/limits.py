"""What one request may ask of the server, so that no request costs its neighbours more than its share.

A request body is read up to ``max_body_bytes`` (the server's setting) and refused with 413 past it, before it is
parsed. Stop strings are scanned on the engine's thread at every token, so their number and length are capped.
A temperature between 0 and ``MIN_TEMPERATURE`` is refused: it is greedy in all but name, and below about 1e-38
the logits divided by it overflow. A prompt's text longer than the context could hold even in the vocabulary's
longest tokens (``max_prompt_chars``) is refused before it is tokenised, which for a body of megabytes takes
seconds.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string
MIN_TEMPERATURE = 0.01  # the smallest nonzero temperature (vLLM clamps below 0.01 for the same reason)
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit int
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a prompt that fills a 128k-token context is about 0.5 MB of text


def max_prompt_chars(tokenizer, max_seq_len: int) -> int:
    """The most characters ``max_seq_len`` tokens can spell: each token spells at most as many characters as its
    longest vocabulary entry has (a byte-level entry has one character per byte, and a character of text is at
    least one byte)."""
    return max_seq_len * max(len(token) for token in tokenizer.get_vocab())


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (declared, or counted as it arrives) is refused with
    413 when the route reads it; the route's error handler answers it in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared.isdigit() and int(declared) > self.max_bytes:
                self._refuse()
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                self._refuse()
            return message

        await self.app(scope, limited, send)

    def _refuse(self) -> None:
        raise HTTPException(
            413,
            f"the request body is over {self.max_bytes} bytes, this server's limit; send a "
            "shorter prompt, or start the server with a larger max_body_bytes=",
        )
