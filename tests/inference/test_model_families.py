"""The model-family matrix: tiny random configs of every decoder family a user is likely to bring (built from
transformers' config classes, nothing downloaded). For each, the runner that serves it, and greedy equality with
transformers' ``generate`` of ``ar``, ``sps`` (the target as its own draft), ``eagle3_tree`` (a random EAGLE-3
drafter) and ``self_draft``, with sliding windows short enough to matter where the family has one.

README's "Model families" table lists the same matrix; keep them in step."""

from __future__ import annotations

import pytest
import torch
import transformers
from eagle3_tree_builders import random_drafter
from family_models import FAMILIES, MAX_SEQ, VOCAB, tiny_model
from specblock_tree_builders import random_drafter as random_specblock_drafter
from ssd_helpers import tiny_draft_runner
from tiny_targets import GREEDY, hf_greedy

from inference.algorithms import build_algorithm
from inference.runner_contract import attention_windows
from inference.runner_loading import load_runner

PROMPT, N_NEW = [5, 17, 33, 9, 71, 40], 24  # 30 tokens: far past the window of 8


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model = tiny_model(request.param)
    return request.param, model, hf_greedy(model, PROMPT, N_NEW)


def serve(model):
    return load_runner(model, max_seq_len=MAX_SEQ)


def test_the_runner_that_serves_it(family):
    name, model, _ = family
    assert type(serve(model)) is FAMILIES[name][3]


@pytest.mark.parametrize("algorithm", ["ar", "sps", "eagle3_tree", "self_draft"])
def test_greedy_equals_transformers_generate(family, algorithm):
    name, model, reference = family
    target = serve(model)
    if algorithm == "sps":
        built = build_algorithm("sps", target, serve(model), gamma=4)
    elif algorithm == "eagle3_tree":
        drafter = random_drafter(model, draft_vocab=64)
        built = build_algorithm("eagle3_tree", target, drafter, tree_depth=3, tree_topk=2, tree_total=8)
    elif algorithm == "self_draft":
        built = build_algorithm("self_draft", target, branch_len=3, branch_num=2)
    else:
        built = build_algorithm("ar", target)
    result = built.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY)
    assert result.tokens == reference, f"{name}: {algorithm} differs from transformers' generate"
    if algorithm == "sps":  # the target drafting for itself: every draft is accepted
        assert result.stats.rollback_rate == 0.0


@pytest.mark.parametrize("algorithm", ["sps@hsd", "pearl", "specbranch", "ssd", "specblock_tree"])
def test_every_other_algorithm_serves_a_local_global_window_target(algorithm):
    """Gemma-3's local/global pattern with a window of 8, through the algorithms the matrix above leaves out."""
    model = tiny_model("gemma3 (text)")
    target = serve(model)
    draft = tiny_draft_runner(1, vocab=VOCAB)  # a Llama draft: a target's family does not bind its draft's
    built = {
        "sps@hsd": lambda: build_algorithm("sps", target, draft, gamma=4, verifier="hsd"),
        "pearl": lambda: build_algorithm("pearl", target, draft, gamma=3),
        "specbranch": lambda: build_algorithm("specbranch", target, draft, gamma=3),
        "ssd": lambda: build_algorithm("ssd", target, draft, gamma=3, budget=3, fallback="fast", fast="random"),
        "specblock_tree": lambda: build_algorithm(
            "specblock_tree", target, random_specblock_drafter(model, draft_vocab=64), budget=16, width=4
        ),
    }[algorithm]()
    assert built.generate(PROMPT, max_new_tokens=N_NEW, sampling=GREEDY).tokens == hf_greedy(model, PROMPT, N_NEW)


def test_a_window_that_matters_is_applied():
    """Without its window the Mistral config gives other tokens: the equality above is not vacuous."""
    windowed = tiny_model("mistral (sliding window)")
    full = tiny_model("mistral (full)")
    full.load_state_dict(windowed.state_dict())
    assert hf_greedy(windowed, PROMPT, N_NEW) != hf_greedy(full, PROMPT, N_NEW)


def test_unsupported_family_is_refused_in_one_line():
    config = transformers.Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"lfm2 has \['conv'\] attention layers"):
        serve(model)


@pytest.mark.parametrize(
    "config_class, kind",
    [("Llama4TextConfig", "chunked_attention"), ("Qwen3NextConfig", "linear_attention"), ("FalconH1Config", "hybrid")],
)
def test_other_attention_kinds_are_refused(config_class, kind):
    config = getattr(transformers, config_class)()
    with pytest.raises(ValueError, match=rf"{config.model_type} has \['{kind}'\] attention layers"):
        attention_windows(config)
