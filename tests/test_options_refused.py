"""Options that do nothing in a setting are refused there (one line naming the option, why, and the fix), and
accepted where they take effect: every refusal is paired with the setting that makes the option act."""

from __future__ import annotations

import pytest

from core.overrides import OverrideError
from inference import evaluate as evaluate_cli
from inference import generate as generate_cli
from inference.serve.config import parse_args as serve_args

# (argv, the whole refusal, an argv where the same option takes effect)
REFUSED = [
    (["algorithms=[ssd]", "ssd_fast=random"],
     "ssd_fast does nothing with ssd_fallback=jit; set ssd_fallback=fast or auto or drop ssd_fast",
     ["algorithms=[ssd]", "ssd_fast=random", "ssd_fallback=auto"]),
    (["algorithms=[ssd]", "ssd_fork_vocab=draft"],
     "ssd_fork_vocab does nothing with draft_vocab=0; set draft_vocab=N (a vocabulary-limited drafter) or drop "
     "ssd_fork_vocab",
     ["algorithms=[ssd@draft_vocab=64]", "ssd_fork_vocab=draft"]),
    (["algorithms=[self_draft]", "self_draft_corpus_candidates=1"],
     "self_draft_corpus_candidates does nothing with ngram_corpus=None; set ngram_corpus=FILE (python -m "
     "data_prep.ngram_corpus) or drop self_draft_corpus_candidates",
     ["algorithms=[self_draft]", "self_draft_corpus_candidates=1", "ngram_corpus=corpus.pt"]),
    (["algorithms=[eagle3_tree@adapt=bandit]", "adapt_lora_rank=4"],
     "adapt_lora_rank does nothing with adapt_arms=head,full; set adapt_arms with lora in it (e.g. "
     "adapt_arms=head,full,lora) or drop adapt_lora_rank",
     ["algorithms=[eagle3_tree@adapt=bandit]", "adapt_lora_rank=4", "adapt_arms=head,full,lora"]),
    (["algorithms=[eagle3_tree]", "adapt_lora_lr=0.1"],
     "adapt_lora_lr does nothing with adapt=none; set adapt other than none or drop adapt_lora_lr",
     ["algorithms=[eagle3_tree]", "adapt=bandit", "adapt_arms=lora", "adapt_lora_lr=0.1"]),
    (["algorithms=[eagle3_tree]", "adapt=bandit", "adapt_arms=lora", "adapt_head_lr=0.1"],
     "adapt_head_lr does nothing with adapt_arms=lora; set adapt_arms with head in it or drop adapt_head_lr",
     ["algorithms=[eagle3_tree]", "adapt=bandit", "adapt_arms=head", "adapt_head_lr=0.1"]),
    (["algorithms=[specbranch]", "hrad=class2", "specbranch_eps=0.5"],
     "specbranch_eps does nothing with hrad=class2; set hrad=none, oracle or an H-RAD export (class0, class2 and "
     "oracle_keep never cut by confidence) or drop specbranch_eps",
     ["algorithms=[specbranch]", "hrad=none", "specbranch_eps=0.5"]),
    (["algorithms=[specbranch@hrad=oracle_keep@specbranch_cut_from=1]"],
     "algorithm variant 'specbranch@hrad=oracle_keep@specbranch_cut_from=1': specbranch_cut_from does nothing "
     "with hrad=oracle_keep; set hrad=none, oracle or an H-RAD export (class0, class2 and oracle_keep never cut by "
     "confidence) or drop specbranch_cut_from",
     ["algorithms=[specbranch@hrad=oracle@specbranch_cut_from=1]"]),
    # sampling filters and the seed at temperature 0
    (["algorithms=[sps]", "top_k=5"],
     "top_k does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
     "draw); set temperature > 0 to sample, or drop top_k",
     ["algorithms=[sps]", "top_k=5", "temperature=0.7"]),
    (["algorithms=[ar]", "top_p=0.9"],
     "top_p does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
     "draw); set temperature > 0 to sample, or drop top_p",
     ["algorithms=[ar,ar@temperature=1]", "top_p=0.9"]),  # read by the sampling variant
    (["algorithms=[ar@seed=3]"],
     "algorithm variant 'ar@seed=3': seed does nothing at temperature=0 (greedy: the argmax, which no top_k or "
     "top_p removes, and no random draw); set temperature > 0 to sample, or drop seed",
     ["algorithms=[ar@temperature=1@seed=3]"]),
    (["algorithms=[ssd]", "seed=3"],
     "seed does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
     "draw); set temperature > 0 to sample, or drop seed",
     ["algorithms=[ssd]", "seed=3", "ssd_fallback=fast"]),  # greedy, but the fast fallback draws random tokens
]


@pytest.mark.parametrize("argv, message, acting", REFUSED, ids=[case[0][-1] for case in REFUSED])
def test_an_option_that_does_nothing_is_refused_and_accepted_where_it_acts(argv, message, acting, tmp_path):
    with pytest.raises(OverrideError) as exc:
        evaluate_cli.parse_args([*argv, f"out={tmp_path}"])
    assert str(exc.value) == message
    evaluate_cli.parse_args([*acting, f"out={tmp_path}"])


def test_filters_left_off_are_not_refused_at_temperature_0(tmp_path):
    evaluate_cli.parse_args(["algorithms=[ar]", "top_k=0", "top_p=1.0", f"out={tmp_path}"])


def test_generate_refuses_sampling_options_at_temperature_0(capsys):
    assert generate_cli.main(["prompt=hi", "algorithm=ar", "top_k=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: top_k does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no "
        "random draw); set temperature > 0 to sample, or drop top_k")


def test_a_servers_sampling_settings_are_request_defaults_and_not_refused():
    # a request may set temperature > 0 and then samples with the server's top_k, top_p and seed stream
    cfg = serve_args(["algorithm=ar", "temperature=0", "top_k=5", "top_p=0.9", "seed=3"])
    assert (cfg.top_k, cfg.top_p, cfg.seed) == (5, 0.9, 3)
    with pytest.raises(OverrideError, match="^ssd_fast does nothing with ssd_fallback=jit; "):
        serve_args(["algorithm=ssd", "ssd_fast=random"])
