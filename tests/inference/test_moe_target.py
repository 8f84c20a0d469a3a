"""Mixture-of-experts targets (tiny Qwen3-MoE and Qwen2-MoE, built from transformers' config classes, nothing
downloaded) on the native runner: the sparse expert MLPs against transformers' forward; exact mode's guarantee on
the MoE path (a token's logits are the same whichever tokens share its call: blocks, trees, batches of rows); the
probe covering that path; every algorithm's greedy output equal to AR's with drafters that accept; and the training
pipeline on a Qwen3-MoE target (feature extraction, an EAGLE-3 fit through spectrain.fit, its export served
losslessly)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fitted_drafters import fit_dflash, fit_eagle3, fit_peagle, fit_specblock
from tiny_targets import hf_greedy
from eagle3_training_builders import eagle3_fit_setup
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from core.drafters.eagle3.kind import load_eagle3
from core.drafters.hrad import HRAD, HRADConfig, HRADPredictor, capture_layers
from core.kernels import exact_cpu
from data_prep.capture import HiddenCapture
from data_prep.extract import extract, parse_args
from data_prep.features import FeatureDataset
from data_prep.samples import TokenSample
from inference import exactness
from inference.algorithms import ALGORITHMS, build_algorithm
from inference.drafters import load_lm
from inference.exactness import tree_mask
from inference.llama import SparseMoe
from inference.runner import ModelRunner
from inference.runner_loading import load_runner
from inference.sampling import SamplingParams
from spectrain import export as export_cli
from spectrain import fit as fit_cli

GREEDY = SamplingParams(temperature=0)
VOCAB = 128
# Qwen3-MoE's shapes in small: 8 experts of width 16, two per token; layer 0 dense (mlp_only_layers), as some
# checkpoints have it.
MOE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# routing layouts transformers supports: every layer sparse, unnormalised weights, every second layer; Qwen2-MoE's
# shared expert (with its sigmoid gate) beside the routed ones, and its qkv bias
VARIANTS = {
    "dense layer 0, normalised top-2": {},
    "every layer sparse, unnormalised top-3": {
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "num_experts_per_tok": 3,
    },
    "every second layer sparse": {"mlp_only_layers": [], "decoder_sparse_step": 2},
    "qwen2-moe, shared expert": {"family": "qwen2_moe", "shared_expert_intermediate_size": 32},
}
FAMILY_CLASSES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}
PROMPT, NEW = [5, 17, 33, 9, 71, 40, 3, 88], 40


def tiny_moe(seed: int = 0, family: str = "qwen3_moe", **overrides) -> Qwen3MoeForCausalLM | Qwen2MoeForCausalLM:
    config_class, model_class = FAMILY_CLASSES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**MOE, **overrides})).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # greedy choices far from ties: rounding cannot flip transformers' reference
        for layer in model.model.layers:  # decisive routing (std 0.02 leaves every expert almost equally likely)
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.mul_(10.0)
        for name, param in model.named_parameters():  # transformers starts biases at 0 and norms at 1: test them
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def random_ids(seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def moe():
    return tiny_moe()


# -- the runner against transformers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "approximate"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers_forward(variant, exact):
    model = tiny_moe(**VARIANTS[variant])
    runner = ModelRunner.from_hf_model(model, max_seq_len=64, exact=exact, probe=False)  # the probe: tests below
    sparse = [isinstance(layer.mlp, SparseMoe) for layer in runner.model.layers]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in model.model.layers] and any(sparse)
    ids = random_ids(1, 1, 30)
    with torch.no_grad():
        expected = model(ids).logits[0]
    prefill = runner.forward(ids[:, :20]).logits[0]
    decoded = torch.cat([runner.forward(ids[:, j : j + 1]).logits[0] for j in range(20, 30)])
    torch.testing.assert_close(torch.cat([prefill, decoded]), expected, atol=1e-4, rtol=1e-4)


def test_the_native_runner_serves_it_in_exact_mode_and_a_window_goes_to_transformers(moe):
    runner = load_runner(moe, max_seq_len=96)
    assert type(runner) is ModelRunner and runner.exactness.path == exactness.EXACT
    assert runner.exactness.probe == "passed"
    windowed = tiny_moe(use_sliding_window=True, sliding_window=8)
    assert type(load_runner(windowed, max_seq_len=96)).__name__ == "TransformersRunner"


# -- exact mode on the MoE path --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, dtype",
    [
        ("dense layer 0, normalised top-2", torch.float32),
        ("dense layer 0, normalised top-2", torch.bfloat16),
        ("qwen2-moe, shared expert", torch.float32),
    ],
)
def test_blocks_and_tree_nodes_get_the_logits_of_decoding_alone(variant, dtype):
    """Per-expert gathering gives each expert's linears another row count in every call shape; a token's logits must
    still be bitwise those of decoding it alone."""
    runner = ModelRunner.from_hf_model(tiny_moe(**VARIANTS[variant]), dtype=dtype, max_seq_len=128, probe=False)
    assert runner.exactness.path == exactness.EXACT  # what this test checks is the probe's claim, on every layer
    prompt, tokens = random_ids(2, 1, 30), random_ids(3, 1, 40)
    runner.forward(prompt)
    stepwise = torch.cat([runner.forward(tokens[:, j : j + 1]).logits[0] for j in range(40)])
    for block in (2, 3, 7, 16, 40):
        runner.truncate(30)
        blocked = torch.cat([runner.forward(tokens[:, j : j + block]).logits[0] for j in range(0, 40, block)])
        assert torch.equal(blocked, stepwise), f"block {block}"
    parents = list(exactness.PROBE_TREE)
    mask, depth = tree_mask(parents)
    runner.truncate(30)
    tree = runner.forward(tokens[:, : len(parents)], attention_mask=mask, positions=torch.tensor([depth]) + 30).logits[
        0
    ]
    for node in range(len(parents)):
        runner.truncate(30)
        for i in mask[node].nonzero()[:, 0].tolist():
            decoded = runner.forward(tokens[:, i : i + 1]).logits[0, -1]
        assert torch.equal(tree[node], decoded), f"node {node}"


def test_batched_rows_get_their_solo_logits(moe):
    """Ragged rows decoded side by side and verified as blocks: each row's logits are those of the row alone,
    whatever experts its neighbours' tokens take."""
    lengths = (3, 21, 9)
    prompts = [random_ids(10 + i, n) for i, n in enumerate(lengths)]
    tokens = random_ids(4, len(lengths), 6)
    solo = ModelRunner.from_hf_model(moe, max_seq_len=64)
    expected = []
    for prompt, row in zip(prompts, tokens):
        solo.reset(1)
        solo.forward(prompt[None])
        steps = [solo.forward(row[None, j : j + 1]).logits[0] for j in range(3)]
        expected.append(torch.cat([*steps, solo.forward(row[None, 3:]).logits[0]]))
    batched = ModelRunner.from_hf_model(moe, max_seq_len=64, max_batch_size=len(lengths))
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    batched.reset(len(lengths))
    batched.forward(ids, logit_rows=slice(0, 0))
    batched.truncate(torch.tensor(lengths))
    steps = [batched.forward(tokens[:, j : j + 1]).logits for j in range(3)]
    logits = torch.cat([*steps, batched.forward(tokens[:, 3:]).logits], dim=1)
    for row in range(len(lengths)):
        assert torch.equal(logits[row], expected[row]), f"row {row}"


def test_the_probe_checks_a_sparse_layer_and_catches_routing_that_depends_on_the_call(moe, monkeypatch):
    """The probe's two-layer copy holds a sparse layer even where the first and last are dense; a router whose rows
    depend on how many share the call (emulated) fails the probe, and the runner verifies token by token."""
    dense_ends = tiny_moe(mlp_only_layers=[0, 3])
    runner = ModelRunner.from_hf_model(dense_ends, max_seq_len=64)
    assert [isinstance(layer.mlp, SparseMoe) for layer in runner._probe_runner(exactness.EXACT).model.layers] == [
        True,
        False,
    ]
    route = exact_cpu.route

    def call_dependent(logits, top_k, normalize):
        weights, chosen = route(logits, top_k, normalize)
        if logits.shape[0] > 2:  # a call of several tokens rounds its weights another way
            weights = torch.nextafter(weights, torch.full_like(weights, 2.0))
        return weights, chosen

    monkeypatch.setattr(exact_cpu, "route", call_dependent)
    monkeypatch.setattr(exactness, "_results", {})
    with pytest.warns(exactness.ExactnessWarning, match="other hidden states than decoding it alone"):
        flagged = ModelRunner.from_hf_model(dense_ends, max_seq_len=64)
    assert flagged.exactness.path == exactness.PER_TOKEN and flagged.exactness.bitwise


# -- every algorithm, with drafters that accept ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """(the target, AR's greedy tokens, drafters fit to the sequence AR decodes), fp32; a vocabulary larger than the
    drafters' (fitted_drafters.DRAFT_VOCAB)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test gets (conftest); a module fixture is set up before that applies
    try:
        moe = tiny_moe(vocab_size=512)
        reference = (
            build_algorithm("ar", ModelRunner.from_hf_model(moe, max_seq_len=192))
            .generate(PROMPT, max_new_tokens=NEW, sampling=GREEDY)
            .tokens
        )
        sequence = PROMPT + reference
        drafters = {
            name: fit(moe, sequence)
            for name, fit in (
                ("eagle3_tree", fit_eagle3),
                ("specblock_tree", fit_specblock),
                ("dflash", fit_dflash),
                ("peagle", fit_peagle),
            )
        }
    finally:
        torch.set_num_threads(threads)
    return moe, reference, drafters


def test_ar_equals_transformers_generate(served):
    moe, reference, _ = served
    assert reference == hf_greedy(moe, PROMPT, NEW)


@pytest.mark.parametrize("name", [name for name in ALGORITHMS if name != "ar"])
def test_every_algorithm_equals_ar_with_a_drafter_that_accepts(served, name):
    """Draft-LM algorithms draft with the target itself on the approximate path; the feature drafters were fit to
    this prompt's continuation; Self-Draft reuses the n-grams of the continuation."""
    moe, reference, drafters = served
    drafter, options = drafters.get(name), {}
    if name in ("sps", "pearl", "specbranch", "ssd"):
        drafter = ModelRunner.from_hf_model(moe, max_seq_len=192, exact=False)
    if name == "specbranch":
        layers = moe.config.num_hidden_layers
        options["hrad"] = HRADPredictor(
            HRAD(HRADConfig(hidden_size=moe.config.hidden_size, last_k=4, gamma=4, boundaries=[1, 3])),
            {"layers": {"ids": capture_layers(layers, 4)}},
        )
    algorithm = build_algorithm(name, ModelRunner.from_hf_model(moe, max_seq_len=192), drafter, **options)
    result = algorithm.generate(PROMPT, max_new_tokens=NEW, sampling=GREEDY)
    assert result.tokens == reference
    assert result.stats.accepted_draft_tokens > 0, result.stats


# -- the training pipeline on an MoE target --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_recipe(tmp_path_factory):
    """eagle3_fit_setup's recipe set-up (chats, recipes, a 4-step fit), its target replaced by a Qwen3-MoE with
    SmolLM2's tokenizer (saved in place) and a sharpened head."""
    tmp = tmp_path_factory.mktemp("moe_fit")
    recipes, args, target = eagle3_fit_setup(tmp, steps=4, every=2, warmup=1)
    llama = AutoConfig.from_pretrained(target)
    model = tiny_moe(
        vocab_size=llama.vocab_size, bos_token_id=llama.bos_token_id, eos_token_id=llama.eos_token_id, pad_token_id=None
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0 / 8.0)  # eagle3_fit_setup's sharpening of its target's head
    model.save_pretrained(target)
    return tmp, recipes, args, target


def test_feature_extraction_captures_the_moe_targets_layers(moe_recipe):
    """data_prep.extract over the native MoE runner: aux layers and the final-normed state are transformers'
    hidden states; a padded batch of ragged samples leaves each sample's own."""
    tmp, _, args, target = moe_recipe
    source = next(a for a in args if a.startswith("source="))
    manifest = extract(
        parse_args(
            [
                f"target={target}",
                source,
                "n_samples=6",
                "max_len=64",
                "layers=[0,1,2]",
                "dtype=fp32",
                "batch_size=3",
                "exact=true",  # each sample's features bitwise its own, whatever the batch (checked below)
                f"out={tmp / 'feats'}",
            ]
        )
    )
    assert manifest["complete"] and manifest["num_rows"] == 6
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    dataset = FeatureDataset(tmp / "feats")
    for index in (0, 4):
        sample = dataset[index]
        with torch.no_grad():
            ref = model(sample["input_ids"][None], output_hidden_states=True)
        expected = torch.cat([ref.hidden_states[i + 1][0] for i in (0, 1, 2)], dim=-1)
        torch.testing.assert_close(sample["aux_hidden"], expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sample["last_hidden"], ref.hidden_states[-1][0], atol=1e-5, rtol=1e-4)
    runner = ModelRunner.from_hf_model(model, max_seq_len=64, max_batch_size=2)
    pair = [TokenSample(i, dataset[i]["input_ids"].tolist(), dataset[i]["loss_mask"].tolist()) for i in (0, 4)]
    rows = HiddenCapture(runner, [0, 1, 2], "fp32")(pair)  # in another batch than extraction's (0-2, 3-5)
    for row, index in zip(rows, (0, 4)):
        assert torch.equal(row["aux_hidden"], dataset[index]["aux_hidden"])
        assert torch.equal(row["last_hidden"], dataset[index]["last_hidden"])


def test_eagle3_fits_on_the_moe_target_and_its_export_serves_losslessly(moe_recipe):
    tmp, recipes, args, target = moe_recipe
    result = fit_cli.fit(fit_cli.compose_recipe(args, directory=recipes))
    assert result["trained"] and result["global_step"] == 4
    ckpt = tmp / "runs" / "eagle3_smollm2" / "checkpoints" / "last.ckpt"
    assert export_cli.main([f"ckpt={ckpt}", "format=native", f"out={tmp / 'native'}"]) == 0
    target_lm = load_lm(str(target), max_seq_len=128)
    assert target_lm.runner.config.model_type == "qwen3_moe" and target_lm.runner.exactness.bitwise
    drafter = load_eagle3(str(tmp / "native"), target_lm)
    prompt = [1, 2, 3, 4, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("error", exactness.ExactnessWarning)
        reference = build_algorithm("ar", target_lm.runner).generate(prompt, max_new_tokens=16, sampling=GREEDY)
        tree = build_algorithm("eagle3_tree", target_lm.runner, drafter, tree_depth=3, tree_topk=2, tree_total=8)
        assert tree.generate(prompt, max_new_tokens=16, sampling=GREEDY).tokens == reference.tokens
