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
    (
        ["algorithms=[ssd]", "ssd.fast=random"],
        "ssd.fast does nothing with ssd.fallback=jit; set ssd.fallback=fast or auto or drop ssd.fast",
        ["algorithms=[ssd]", "ssd.fast=random", "ssd.fallback=auto"],
    ),
    (
        ["algorithms=[ssd]", "ssd.fork_vocab=draft"],
        "ssd.fork_vocab does nothing with ssd.draft_vocab=0; set ssd.draft_vocab=N (a vocabulary-limited drafter) or "
        "drop ssd.fork_vocab",
        ["algorithms=[ssd@draft_vocab=64]", "ssd.fork_vocab=draft"],
    ),
    (
        ["algorithms=[self_draft]", "self_draft.corpus_candidates=1"],
        "self_draft.corpus_candidates does nothing with self_draft.corpus=None; set self_draft.corpus=FILE (python -m "
        "data_prep.ngram_corpus) or drop self_draft.corpus_candidates",
        ["algorithms=[self_draft]", "self_draft.corpus_candidates=1", "self_draft.corpus=corpus.pt"],
    ),
    (
        ["algorithms=[eagle3_tree@adapt=bandit]", "adapt.lora_rank=4"],
        "algorithm variant 'eagle3_tree@adapt=bandit': adapt.lora_rank does nothing with adapt.arms=head,full; set "
        "adapt.arms with lora in it (e.g. adapt.arms=head,full,lora) or drop adapt.lora_rank",
        ["algorithms=[eagle3_tree@adapt=bandit]", "adapt.lora_rank=4", "adapt.arms=head,full,lora"],
    ),
    (
        ["algorithms=[eagle3_tree]", "adapt.lora_lr=0.1"],
        "adapt.lora_lr does nothing with adapt=none; set adapt=NAME (e.g. adapt=bandit) or drop adapt.lora_lr",
        ["algorithms=[eagle3_tree]", "adapt=bandit", "adapt.arms=lora", "adapt.lora_lr=0.1"],
    ),
    (
        ["algorithms=[eagle3_tree]", "adapt=bandit", "adapt.arms=lora", "adapt.head_lr=0.1"],
        "adapt.head_lr does nothing with adapt.arms=lora; set adapt.arms with head in it or drop adapt.head_lr",
        ["algorithms=[eagle3_tree]", "adapt=bandit", "adapt.arms=head", "adapt.head_lr=0.1"],
    ),
    (
        ["algorithms=[specbranch]", "specbranch.hrad=class2", "specbranch.epsilon=0.5"],
        "specbranch.epsilon does nothing with specbranch.hrad=class2; set specbranch.hrad=none, oracle or an H-RAD "
        "export (class0, class2 and oracle_keep never cut by confidence) or drop specbranch.epsilon",
        ["algorithms=[specbranch]", "specbranch.hrad=none", "specbranch.epsilon=0.5"],
    ),
    (
        ["algorithms=[specbranch@hrad=oracle_keep@cut_from=1]"],
        "algorithm variant 'specbranch@hrad=oracle_keep@cut_from=1': specbranch.cut_from does nothing with "
        "specbranch.hrad=oracle_keep; set specbranch.hrad=none, oracle or an H-RAD export (class0, class2 and "
        "oracle_keep never cut by confidence) or drop specbranch.cut_from",
        ["algorithms=[specbranch@hrad=oracle@cut_from=1]"],
    ),
    # sampling filters and the seed at temperature 0
    (
        ["algorithms=[sps]", "top_k=5"],
        "top_k does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
        "draw); set temperature > 0 to sample, or drop top_k",
        ["algorithms=[sps]", "top_k=5", "temperature=0.7"],
    ),
    (
        ["algorithms=[ar]", "top_p=0.9"],
        "top_p does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
        "draw); set temperature > 0 to sample, or drop top_p",
        ["algorithms=[ar,ar@temperature=1]", "top_p=0.9"],
    ),  # read by the sampling variant
    (
        ["algorithms=[ar@seed=3]"],
        "algorithm variant 'ar@seed=3': seed does nothing at temperature=0 (greedy: the argmax, which no top_k or "
        "top_p removes, and no random draw); set temperature > 0 to sample, or drop seed",
        ["algorithms=[ar@temperature=1@seed=3]"],
    ),
    (
        ["algorithms=[ssd]", "seed=3"],
        "seed does nothing at temperature=0 (greedy: the argmax, which no top_k or top_p removes, and no random "
        "draw); set temperature > 0 to sample, or drop seed",
        ["algorithms=[ssd]", "seed=3", "ssd.fallback=fast"],
    ),  # greedy, but the fast fallback draws random tokens
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
        "random draw); set temperature > 0 to sample, or drop top_k"
    )


def test_a_servers_sampling_settings_are_request_defaults_and_not_refused():
    # a request may set temperature > 0 and then samples with the server's top_k, top_p and seed stream
    cfg = serve_args(["algorithm=ar", "temperature=0", "top_k=5", "top_p=0.9", "seed=3"])
    assert (cfg.top_k, cfg.top_p, cfg.seed) == (5, 0.9, 3)
    with pytest.raises(OverrideError, match=r"^ssd\.fast does nothing with ssd\.fallback=jit; "):
        serve_args(["algorithm=ssd", "ssd.fast=random"])
