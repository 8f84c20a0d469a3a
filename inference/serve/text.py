"""Token ids to the text a client sees, piece by piece, with OpenAI's ``stop`` strings.

Detokenising is incremental, the way vLLM's detokenizer does it: a new token decodes only a short window of
tokens, from ``prefix_offset`` to the end. The tokens before ``read_offset`` are text already; the window starts a
few tokens earlier because a tokenizer needs them as context (a SentencePiece word start, a character split over
byte-level tokens), and the new text is what the window decodes to past what its first tokens decode to. A window
that ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token. So each token costs a decode of a few
tokens, not of the whole answer.

The text is the tokens' own text, decoded without ``clean_up_tokenization_spaces``: that pass rewrites text that
was already sent (``"x ."`` becomes ``"x."``) and changes what the model wrote; vLLM leaves it off too. Streamed
and non-streamed answers both take their text from this class, so the concatenated deltas of a stream are the
non-streamed text exactly. A delta is held back while the text ends in the start of a stop string; at a stop
string the text ends before it, and the tokens after the one that completed it are dropped (OpenAI counts and
returns neither).
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Token ids in, their new text out (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window's first token: context for decoding the tokens after read_offset
        self.read_offset = 0  # tokens before this one are text already
        self._prefix_text = ""  # what tokens[prefix_offset:read_offset] decode to

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """The text ``token`` completes (often empty while a character or a word is incomplete)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still waiting at the end (an incomplete UTF-8 sequence decodes to U+FFFD, as a full decode)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._decode(self.tokens[self.prefix_offset :])
        if len(text) <= len(self._prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        new = text[len(self._prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        return new


class TextAssembler:
    """An answer's text and the deltas a client is sent, ending at the first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []  # the answer's tokens (after a stop string: up to the one that completed it)
        self.stopped = False  # a stop string was met
        self._sent: list[str] = []  # the deltas handed out
        self._held = ""  # text not handed out yet: it may be the start of a stop string
        # the end of the sent text, as long as a stop string less one character: a stop string may begin there
        self._context = ""
        self._keep = max(map(len, self.stop), default=1) - 1

    @property
    def text(self) -> str:
        return "".join(self._sent) + self._held

    def feed(self, new: Sequence[int]) -> tuple[str, int]:
        """``(text delta, how many of new were kept)`` after ``new`` tokens; all are kept unless a stop string
        ends the text among them."""
        if self.stopped:
            return "", 0
        delta = []
        for kept, token in enumerate(new, 1):
            self.tokens.append(int(token))
            delta.append(self._extend(self.detokenizer.add(int(token))))
            if self.stopped:
                return "".join(delta), kept
        return "".join(delta), len(new)

    def flush(self) -> str:
        """The rest of the text once generation ended (what was held back as the start of a stop string)."""
        if self.stopped:
            return ""
        delta = self._extend(self.detokenizer.flush())
        if not self.stopped:
            delta += self._hand_out(len(self._held))
        return delta

    def _extend(self, piece: str) -> str:
        """Add ``piece`` to the text; returns what can be handed out now."""
        if not piece:
            return ""
        window = self._context + self._held + piece  # a stop string that ends in piece starts within the window
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        self._held += piece
        if hits:  # it starts in held text, never in sent text: that would have been held (``_holding``)
            self.stopped = True
            self._held = self._held[: max(min(hits) - len(self._context), 0)]
            return self._hand_out(len(self._held))
        return self._hand_out(len(self._held) - self._holding(window))

    def _hand_out(self, n: int) -> str:
        delta, self._held = self._held[:n], self._held[n:]
        if delta:
            self._sent.append(delta)
            self._context = (self._context + delta)[-self._keep :] if self._keep else ""
        return delta

    def _holding(self, window: str) -> int:
        """Length of the longest end of ``window`` that starts a stop string (it may yet become one), at most
        the held text."""
        longest = 0
        for s in self.stop:
            tail = window[max(len(window) - len(s) + 1, 0) :]
            start = tail.find(s[0])
            while start >= 0 and len(tail) - start > longest:
                if s.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(s[0], start + 1)
        return min(longest, len(self._held))
