"""Token ids to the text a client sees, piece by piece, with OpenAI's ``stop`` strings.

Streamed and non-streamed answers both take their text from this class, so the concatenated deltas of a stream
are the non-streamed text exactly. A delta is held back while the text ends in an incomplete UTF-8 sequence or
in the start of a stop string; at a stop string the text ends before it, and the tokens after the one that
completed it are dropped (OpenAI counts and returns neither).
"""

from __future__ import annotations

from collections.abc import Sequence


class TextAssembler:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = ""  # the text handed out so far
        self.stopped = False  # a stop string was met

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def feed(self, new: Sequence[int]) -> tuple[str, int]:
        """``(text delta, how many of new were kept)`` after ``new`` tokens; all are kept unless a stop string
        ends the text among them."""
        if self.stopped:
            return "", 0
        before = len(self.tokens)
        self.tokens.extend(int(t) for t in new)
        text = self._decode(self.tokens)
        hit = self._find_stop(text)
        if hit is not None:
            kept = self._tokens_to_stop(before)
            self.tokens = self.tokens[:before + kept]
            self.stopped = True
            return self._hand_out(text[:hit]), kept
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: the next token completes it
            return "", len(new)
        return self._hand_out(text[:len(text) - self._held(text)]), len(new)

    def flush(self) -> str:
        """The rest of the text once generation ended (what was held back as the start of a stop string)."""
        if self.stopped:
            return ""
        return self._hand_out(self._decode(self.tokens))

    def _hand_out(self, upto: str) -> str:
        # Decoding is prefix-stable for byte-level BPE; if a tokenizer ever rewrote earlier text, wait for the end.
        if len(upto) <= len(self.sent) or not upto.startswith(self.sent):
            return ""
        delta, self.sent = upto[len(self.sent):], upto
        return delta

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _tokens_to_stop(self, before: int) -> int:
        """How many of the tokens after ``before`` it takes for a stop string to appear."""
        for kept in range(1, len(self.tokens) - before + 1):
            if self._find_stop(self._decode(self.tokens[:before + kept])) is not None:
                return kept
        return len(self.tokens) - before

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that starts a stop string (it may yet become one)."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held
