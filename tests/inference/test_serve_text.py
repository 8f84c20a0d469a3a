"""``inference.serve.text``: incremental detokenising with stop strings, on SmolLM2's real tokenizer and on a
byte-level tokenizer with ``clean_up_tokenization_spaces`` on, built offline with the ``tokenizers`` library."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from core.assets import load_tokenizer
from inference.serve.text import TextAssembler


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2")


def cleanup_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokens ``x``, ``" "``, ``.``, ``" more"`` with the clean-up pass on (Llama-3 tokenizers set it;
    transformers now skips it for BPE unless forced): a full decode of all four gives ``"x. more"``, a decode of the
    first two ``"x "``, so decoding is not prefix-stable."""
    backend = Tokenizer(models.BPE(vocab={"x": 0, "Ġ": 1, ".": 2, "Ġmore": 3}, merges=[]))
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )


def streamed(tokenizer, ids: list[int], stop: list[str] = (), chunks: list[int] | None = None) -> tuple[list[str], int]:
    """(the deltas a client is sent, then the flushed rest; tokens kept) feeding ``ids`` in ``chunks``."""
    text, deltas, kept, at = TextAssembler(tokenizer, stop), [], 0, 0
    for size in chunks or [1] * len(ids):
        delta, n = text.feed(ids[at : at + size])
        deltas.append(delta)
        kept += n
        at += size
        if text.stopped:
            break
    deltas.append(text.flush())
    return deltas, kept


def test_a_tokenizer_that_cleans_up_spaces_loses_no_text():
    tokenizer = cleanup_tokenizer()
    assert tokenizer.decode([0, 1]) == "x " and tokenizer.decode([0, 1, 2, 3]) == "x. more"  # not prefix-stable
    deltas, kept = streamed(tokenizer, [0, 1, 2, 3])
    assert deltas == ["x", " ", ".", " more", ""] and kept == 4  # the tokens' own text, nothing rewritten
    assert "".join(streamed(tokenizer, [0, 1, 2, 3], chunks=[4])[0]) == "x . more"  # not streamed: the same


def test_a_character_split_over_tokens_waits_for_its_last_byte(smollm2):
    parrot = smollm2("🦜", add_special_tokens=False)["input_ids"]
    assert len(parrot) == 3 and all(smollm2.decode([t]) == "\ufffd" for t in parrot)  # three byte tokens
    ids = smollm2("a", add_special_tokens=False)["input_ids"] + parrot
    deltas, _ = streamed(smollm2, ids)
    assert deltas == ["a", "", "", "🦜", ""]
    cut = streamed(smollm2, ids[:-1])[0]  # an answer that ends mid-character: its bytes come out at the end
    assert cut == ["a", "", "", "\ufffd"] and "".join(cut) == smollm2.decode(ids[:-1])


def test_stop_strings_across_token_boundaries(smollm2):
    ids = smollm2("Hello wörld 🦜 — done. Stop here!", add_special_tokens=False)["input_ids"]
    deltas, kept = streamed(smollm2, ids, stop=["ld 🦜"])
    # "ld" was held back as the start of the stop string: sent text is never taken back, and none of it was sent
    assert "".join(deltas) == "Hello wör" and smollm2.decode(ids[:kept]).endswith("ld 🦜")
    assert "ld 🦜" not in smollm2.decode(ids[: kept - 1])  # the token that completed it is the last one kept
    deltas, kept = streamed(smollm2, ids, stop=["ld!"])  # held back, then released when it is no stop after all
    assert "".join(deltas) == smollm2.decode(ids) and kept == len(ids)
    assert streamed(smollm2, ids, stop=["Stop", "wö"], chunks=[len(ids)]) == (["Hello ", ""], 3)


def test_streamed_text_is_the_non_streamed_text(smollm2):
    """Random answers (byte tokens included, so characters split), fed in random chunk sizes, with stop strings
    taken from their text: the deltas always add up to the text of one feed, which is the tokens' own text cut
    at the first stop string."""
    rng = random.Random(0)
    multibyte = smollm2("🦜 鬱 ḝ 𝔘 é", add_special_tokens=False)["input_ids"]
    for case in range(150):
        ids = [rng.choice(multibyte) if rng.random() < 0.3 else rng.randrange(200, 20000) for _ in range(24)]
        full = smollm2.decode(ids, clean_up_tokenization_spaces=False)
        stops = [full[i : i + rng.randint(1, 6)] for i in sorted(rng.sample(range(len(full)), 2))] if case % 2 else []
        hits = [full.find(s) for s in stops if s and full.find(s) >= 0]
        expected = full[: min(hits)] if hits else full
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        once, kept_once = streamed(smollm2, ids, stops, chunks=[len(ids)])
        deltas, kept = streamed(smollm2, ids, stops, chunks=chunks)
        assert "".join(deltas) == "".join(once) == expected, case
        assert kept == kept_once and (kept == len(ids) or stops), case


class DecodeCounter:
    """SmolLM2's tokenizer, counting the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_each_token_decodes_a_short_window_not_the_whole_answer(smollm2):
    ids = smollm2("The quick brown fox jumps over the lazy dog. " * 100, add_special_tokens=False)["input_ids"]
    counter = DecodeCounter(smollm2)
    deltas, _ = streamed(counter, ids, stop=["never met"])
    assert "".join(deltas) == smollm2.decode(ids)
    assert counter.decoded < 8 * len(ids)  # a full re-decode per token costs len(ids)**2 / 2 = 500,000 here
