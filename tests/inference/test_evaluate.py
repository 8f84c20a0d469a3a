"""The evaluation and generation CLIs: results schema, AR baseline in the same run, one-line errors."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from tiny_targets import save_tiny_target

from core.overrides import OverrideError
from inference import engine_args, exactness
from inference import evaluate as evaluate_cli
from inference import generate as generate_cli
from inference.drafters import LoadedModel, load_draft_lm
from inference.report import markdown_table
from inference.runner import ModelRunner


def loaded(smollm2, max_seq_len: int = 512) -> LoadedModel:
    model, tokenizer = smollm2
    # A fresh runner shares the model's weights but owns its KV cache, so target and draft can be one model.
    return LoadedModel("smollm2", ModelRunner.from_hf_model(model, max_seq_len=max_seq_len), tokenizer, model)


@pytest.mark.real_model
def test_evaluate_writes_results_with_same_run_ar_baseline(smollm2, tmp_path):
    cfg = evaluate_cli.parse_args(
        [
            "algorithms=sps",
            "drafter=smollm2",
            "bench=mt_bench",
            "n_prompts=1",
            "max_new_tokens=16",
            "gamma=4",
            "verifier=hsd",
            f"out={tmp_path}",
            "warmup=false",
        ]
    )
    results = evaluate_cli.evaluate(cfg, target=loaded(smollm2), draft=loaded(smollm2))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["runs"] == results["runs"]
    ar, sps = results["runs"]
    assert (ar["algorithm"], sps["algorithm"]) == ("ar", "sps")
    expected_keys = {
        "algorithm",
        "bench",
        "n_prompts",
        "new_tokens",
        "wall_s",
        "tokens_per_s",
        "target_forwards",
        "tau",
        "draft_forwards",
        "rollback_rate",
        "acceptance_by_position",
        "greedy_equal_to_ar",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "max_new_tokens",
    }
    assert expected_keys <= set(sps)
    assert sps["greedy_equal_to_ar"] is True and ar["greedy_equal_to_ar"] is True
    # the target drafting for itself accepts everything: 1 prefill token + 5 per round -> 16 tokens in 4 forwards
    assert sps["new_tokens"] == ar["new_tokens"] == 16
    assert sps["target_forwards"] == 4 and sps["tau"] == 4.0 and sps["rollback_rate"] == 0.0
    assert sps["acceptance_by_position"] == [1.0, 1.0, 1.0, 1.0]
    assert sps["accepted_hist"] == [0, 0, 0, 0, 3]  # three rounds kept all 4 drafted tokens
    assert set(results["speedup_vs_ar"]) == {"ar", "sps"} and results["speedup_vs_ar"]["ar"] == 1.0
    report = (tmp_path / "report.md").read_text()
    assert "| sps | mt_bench | greedy | 1 | 16 | 4.00 |" in report
    # which path ran and on what grounds: the fp32 one-row runner is exact and its probe passed
    assert results["exactness"]["path"] == "exact" and results["exactness"]["bitwise"] is True
    assert "exactness: exact path, probe passed; greedy output is bitwise AR's by construction" in report
    assert "Not lossless" not in report
    for png in ("acceptance.png", "speedup.png", "tau_distribution.png"):
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.parametrize(
    "args, needle",
    [
        (["algorithms=[ar,nope]"], "unknown algorithm 'nope'; available: ar, sps"),
        (["algoritms=[ar]"], "unknown key 'algoritms' (did you mean 'algorithms'?)"),
        (["algorithms=[sps]", "n_prompts=1"], "'sps' needs a draft LM"),
        (["temperature=-1"], "temperature must be a finite number >= 0"),
        (["target=/no/such/model"], "unknown model '/no/such/model'"),
    ],
)
def test_evaluate_cli_errors_are_one_line(args, needle, capsys, tmp_path):
    assert evaluate_cli.main([*args, f"out={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_list_fields_accept_a_single_value():
    cfg = evaluate_cli.parse_args(["bench=humaneval", "algorithms=sps"])
    assert list(cfg.bench) == ["humaneval"] and list(cfg.algorithms) == ["sps"]
    assert OmegaConf.to_container(evaluate_cli.parse_args(["bench=[mt_bench,humaneval]"]).bench) == [
        "mt_bench",
        "humaneval",
    ]


@pytest.mark.real_model
def test_prompt_longer_than_the_cache_is_one_line(smollm2, capsys, tmp_path):
    cfg = evaluate_cli.parse_args(["n_prompts=1", "max_new_tokens=64", "max_seq_len=64", f"out={tmp_path}"])
    with pytest.raises(ValueError, match=r"needs \d+ cache slots but max_seq_len=64; shorten the prompt"):
        evaluate_cli.evaluate(cfg, target=loaded(smollm2, max_seq_len=64))


@pytest.mark.real_model
def test_drafter_with_another_tokenizer_is_refused(smollm2, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = smollm2
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer) + 1,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["<spectrain-extra-token>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has a different tokenizer than target 'smollm2'"):
        load_draft_lm(str(tmp_path), loaded(smollm2))


@pytest.mark.real_model
def test_generate_streams_the_answer(smollm2, capsys):
    cfg, _ = generate_cli.parse_engine_cli(
        ["prompt=What is the capital of France?", "max_new_tokens=12"], generate_cli.GenerateConfig, generate_cli.USAGE
    )
    streamer = generate_cli.TextStreamer(smollm2[1])
    result = generate_cli.generate_text(cfg, loaded(smollm2), on_tokens=streamer)
    assert capsys.readouterr().out == "The capital of France is Paris."
    assert result.stats.new_tokens == 8  # the answer ends with <|im_end|>, an EOS of the chat template


@pytest.mark.real_model
def test_generate_with_a_vocabulary_limited_draft_gives_the_same_answer(smollm2, capsys):
    cfg, _ = generate_cli.parse_engine_cli(
        ["prompt=What is the capital of France?", "max_new_tokens=12", "algorithm=sps", "sps.draft_vocab=1000"],
        generate_cli.GenerateConfig,
        generate_cli.USAGE,
    )
    streamer = generate_cli.TextStreamer(smollm2[1])
    result = generate_cli.generate_text(cfg, loaded(smollm2), loaded(smollm2), on_tokens=streamer)
    assert capsys.readouterr().out == "The capital of France is Paris."
    # the target drafting for itself accepts all 8 drafted tokens unlimited; 3575, 4649 and 7042 lie beyond id 1000
    assert 0 < result.stats.accepted_draft_tokens < result.stats.drafted_tokens


def test_every_algorithm_reads_its_options_alike_from_both_clis():
    args = ["sps.gamma=3", "eagle3_tree.tree_depth=2", "self_draft.branch_len=5"]
    eval_cfg = evaluate_cli.parse_args(["algorithms=[sps,eagle3_tree,self_draft]", *args])
    gen_cfg, _ = generate_cli.parse_engine_cli(["prompt=hi", *args], generate_cli.GenerateConfig, generate_cli.USAGE)
    for name in ("ar", "sps", "eagle3_tree", "self_draft"):
        assert eval_cfg[name] == gen_cfg[name], name
    assert (eval_cfg.sps.gamma, eval_cfg.eagle3_tree.tree_depth, eval_cfg.self_draft.branch_len) == (3, 2, 5)


def _fake_export(path, kind: str):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"spectrain": {"kind": kind}}))
    return path


def test_drafters_dir_is_indexed_by_export_kind_and_explicit_paths_win(tmp_path):
    for kind in ("draft_lm", "eagle3", "specblock", "hrad"):
        _fake_export(tmp_path / "exports" / kind, kind)
    cfg = evaluate_cli.parse_args([f"drafters={tmp_path / 'exports'}", "algorithms=all"])
    paths = evaluate_cli.drafter_paths(cfg)
    assert {k: p.rsplit("/", 1)[-1] for k, p in paths.items()} == {
        "draft_lm": "draft_lm",
        "eagle3": "eagle3",
        "specblock": "specblock",
        "hrad": "hrad",
    }
    other = _fake_export(tmp_path / "other_e3", "eagle3")
    cfg = evaluate_cli.parse_args([f"drafters={tmp_path / 'exports'}", f"drafter={other}"])
    assert evaluate_cli.drafter_paths(cfg)["eagle3"] == str(other)  # drafter=PATH goes by the export's kind


def test_two_exports_of_one_kind_are_refused(tmp_path):
    _fake_export(tmp_path / "a", "eagle3")
    _fake_export(tmp_path / "b", "eagle3")
    cfg = evaluate_cli.parse_args([f"drafters={tmp_path}"])
    with pytest.raises(ValueError, match="holds 2 'eagle3' exports"):
        evaluate_cli.drafter_paths(cfg)


def test_all_runs_what_the_drafters_allow_and_says_what_it_skipped():
    cfg = evaluate_cli.parse_args(["algorithms=all"])
    labels, skipped = evaluate_cli.select_algorithms(cfg, {"draft_lm"})
    assert labels[0] == "ar" and {"sps", "self_draft", "pearl", "specbranch", "ssd"} <= set(labels)
    assert set(skipped) == {"eagle3_tree", "specblock_tree", "dflash", "peagle"}
    assert "EAGLE-3 export" in skipped["eagle3_tree"] and "DFlash export" in skipped["dflash"]
    assert "P-EAGLE export" in skipped["peagle"]
    cfg = evaluate_cli.parse_args(["algorithms=[sps,eagle3_tree]"])
    with pytest.raises(OverrideError, match="'eagle3_tree' needs an EAGLE-3 export"):
        evaluate_cli.select_algorithms(cfg, {"draft_lm"})


@pytest.mark.parametrize(
    "variant, needle",
    [
        ("sps@verifier", "'verifier' is not key=value"),
        ("sps@verifer=hsd", "unknown key 'verifer' (did you mean 'verifier'?)"),
        ("nope@gamma=2", "unknown algorithm 'nope'"),
    ],
)
def test_bad_variants_fail_before_loading(variant, needle, tmp_path, capsys):
    assert evaluate_cli.main([f"algorithms=[{variant}]", f"out={tmp_path}"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.real_model
def test_variants_run_side_by_side_with_their_own_options(smollm2, tmp_path):
    cfg = evaluate_cli.parse_args(
        [
            "algorithms=[sps,sps@verifier=hsd@gamma=2,sps@draft_vocab=300]",
            "bench=mt_bench",
            "n_prompts=1",
            "max_new_tokens=12",
            "gamma=4",
            f"out={tmp_path}",
            "warmup=false",
        ]
    )
    results = evaluate_cli.evaluate(cfg, target=loaded(smollm2), draft=loaded(smollm2))
    labels = [r["algorithm"] for r in results["runs"]]
    assert labels == ["ar", "sps", "sps@verifier=hsd@gamma=2", "sps@draft_vocab=300"]
    sps, variant, limited = results["runs"][1:]
    assert sps["greedy_equal_to_ar"] and variant["greedy_equal_to_ar"] and limited["greedy_equal_to_ar"]
    assert len(sps["acceptance_by_position"]) == 4 and len(variant["acceptance_by_position"]) == 2  # its own gamma
    # The target drafting for itself accepts everything, except tokens above the 300 ids it may propose.
    assert sps["rollback_rate"] == 0.0 < limited["rollback_rate"] and limited["tau"] < sps["tau"]


def test_report_shows_each_algorithm_its_own_figures():
    from inference.report import markdown_table

    base = {
        "bench": "mt_bench",
        "n_prompts": 1,
        "new_tokens": 8,
        "tau": 1.5,
        "tokens_per_s": 3.0,
        "speedup_vs_ar": 0.5,
        "rollback_rate": 0.9,
        "target_forwards": 4,
        "draft_forwards": 8,
        "greedy_equal_to_ar": True,
    }
    runs = [
        dict(base, algorithm="sps"),
        dict(base, algorithm="ssd", cache_hit_rate=0.25, simulated_tokens_per_s=4.0),
        dict(
            base,
            algorithm="specbranch",
            rollback_rate_speculated=0.5,
            simulated_tokens_per_s=5.0,
            executor="multiprocess",
        ),
    ]
    rows = markdown_table({"config": {}, "runs": runs}).splitlines()
    assert rows[-3].endswith("| yes | – | – |")
    assert rows[-2].endswith("| yes | 4.0 | cache hit rate 0.25 |")
    assert rows[-1].endswith("| yes | 5.0 | rollback (speculated) 0.50; executor multiprocess |")


@pytest.mark.slow
def test_several_multiprocess_variants_run_in_one_evaluation(tmp_path):
    """Each algorithm runs (and releases its draft process and process group) before the next, so two
    multiprocess variants fit in one run; results stay ordered by bench, then algorithm. Tiny target and draft
    (SmolLM2's tokenizer): each draft process starts in seconds."""
    import torch.distributed as dist

    target = save_tiny_target(tmp_path / "target", layers=2, logit_scale=30.0)
    draft = save_tiny_target(tmp_path / "draft", layers=2, noise=0.002)
    cfg = evaluate_cli.parse_args(
        [
            "algorithms=[pearl@executor=multiprocess,specbranch@executor=multiprocess]",
            f"target={target}",
            f"drafter={draft}",
            "hrad=none",
            "bench=[mt_bench,humaneval]",
            "n_prompts=1",
            "max_new_tokens=6",
            "gamma=2",
            "threads=1",
            f"out={tmp_path / 'out'}",
            "warmup=false",
            "device=cpu",
        ]
    )
    results = evaluate_cli.evaluate(cfg)
    labels = [(r["bench"], r["algorithm"].split("@")[0]) for r in results["runs"]]
    assert labels == [(b, a) for b in ("mt_bench", "humaneval") for a in ("ar", "pearl", "specbranch")]
    overlapped = [r for r in results["runs"] if r["algorithm"] != "ar"]
    assert all(r["executor"] == "multiprocess" and r["greedy_equal_to_ar"] for r in overlapped)
    assert not dist.is_initialized()  # the last draft process was released too


# Per-variant sampling, seed and max_new_tokens (issue 24): tiny random Llamas with a small vocabulary, so a run
# over hundreds of prompts takes seconds and the target's law can be enumerated exactly.


def tiny_loaded(seed: int, vocab: int, layers: int, scale: float) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a sharper law than a random init's near-uniform one
        model.lm_head.weight.mul_(scale)
    return LoadedModel(f"tiny{seed}", ModelRunner.from_hf_model(model, max_seq_len=32), None, model)


@pytest.fixture
def tiny_eval(monkeypatch):
    """``run(prompts, args) -> (results, calls)``: evaluate on fixed token prompts (no EOS) with a tiny target and
    draft; ``calls[i]`` lists (sampling, tokens) of every generate call of the i-th algorithm built (ar first)."""
    calls: list[list] = []
    build = engine_args.build_algorithm

    def spying_build(*args, **kwargs):
        algorithm, seen = build(*args, **kwargs), []
        calls.append(seen)
        generate = algorithm.generate

        def spy(prompt, **kw):
            result = generate(prompt, **kw)
            seen.append((kw["sampling"], result.tokens))
            return result

        algorithm.generate = spy
        return algorithm

    monkeypatch.setattr(engine_args, "build_algorithm", spying_build)
    monkeypatch.setattr(evaluate_cli, "eos_token_ids", lambda *a, **k: [])

    def run(prompts: list[list[int]], vocab: int, args: list[str]):
        monkeypatch.setattr(
            evaluate_cli,
            "load_bench_prompts",
            lambda bench, tokenizer, n: evaluate_cli.BenchPrompts(bench, prompts[:n]),
        )
        cfg = evaluate_cli.parse_args([f"n_prompts={len(prompts)}", *args])
        target, draft = tiny_loaded(10, vocab, 2, 3.0), tiny_loaded(11, vocab, 1, 3.0)
        return evaluate_cli.evaluate(cfg, target=target, draft=draft), calls

    return run


def test_a_sampling_variant_in_a_greedy_run_samples_with_its_own_settings(tiny_eval, tmp_path):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    results, calls = tiny_eval(
        prompts,
        16,
        [
            "algorithms=[sps,sps@temperature=1,sps@temperature=1@seed=7,sps@temperature=1@top_k=1]",
            "temperature=0",
            "max_new_tokens=8",
            "gamma=2",
            f"out={tmp_path}",
            "warmup=true",
        ],
    )
    ar, sps, sampled, reseeded, top1 = results["runs"]
    greedy_tokens = [tokens for _, tokens in calls[0][1:]]  # [0] is the warm-up call
    sampled_tokens = [tokens for _, tokens in calls[2][1:]]
    # the warm-up and every prompt of the variant ran with its sampling, not the run's temperature=0
    assert all(sampling.temperature == 1.0 for sampling, _ in calls[2]) and len(calls[2]) == 1 + len(prompts)
    assert sampled_tokens != greedy_tokens
    assert [tokens for _, tokens in calls[3][1:]] != sampled_tokens  # seed=7 draws other tokens
    assert [tokens for _, tokens in calls[4][1:]] == greedy_tokens  # top_k=1 leaves only the argmax
    assert sps["greedy_equal_to_ar"] is True and ar["temperature"] == sps["temperature"] == 0.0
    assert {k: sampled[k] for k in ("temperature", "top_k", "top_p", "seed", "max_new_tokens")} == {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 0,
        "max_new_tokens": 8,
    }
    assert reseeded["seed"] == 7 and top1["top_k"] == 1
    assert all(run.get("greedy_equal_to_ar") is None for run in (sampled, reseeded, top1))
    rows = (tmp_path / "report.md").read_text().splitlines()
    assert "| sps | mt_bench | greedy | 3 | 24 |" in rows[-4] and "| yes |" in rows[-4]
    assert "| sps@temperature=1 | mt_bench | T=1 seed 0 | 3 | 24 |" in rows[-3] and "| sampled |" in rows[-3]
    assert "| T=1 top-k 1 seed 0 |" in rows[-1] and "yes" not in rows[-1]


def test_a_sampling_variant_follows_the_target_law(tiny_eval, tmp_path):
    """Monte Carlo through evaluate: the first 2 tokens of sps@temperature=1 (a different draft, so the second
    token goes through verification) follow the tiny target's law, enumerated exactly; greedy would not. (What a
    variant's settings reach is checked here; the law tests of every algorithm, with their power, are
    ``test_sampling_laws.py``'s.)"""
    vocab, runs, prompt = 4, 300, [1, 2]
    results, calls = tiny_eval(
        [prompt] * runs,
        vocab,
        [
            "algorithms=[sps@temperature=1]",
            "temperature=0",
            "max_new_tokens=2",
            "gamma=2",
            "seed=3",
            f"out={tmp_path}",
            "warmup=false",
        ],
    )
    counts: dict[tuple[int, ...], int] = {}
    for _, tokens in calls[1]:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    model = tiny_loaded(10, vocab, 2, 3.0).model
    law = {}
    for seq in itertools.product(range(vocab), repeat=2):
        with torch.no_grad():
            probs = model(torch.tensor([prompt + list(seq)])).logits[0].double().softmax(-1)
        law[seq] = float(probs[len(prompt) - 1, seq[0]] * probs[len(prompt), seq[1]])
    chi2 = sum((counts.get(s, 0) - runs * p) ** 2 / (runs * p) for s, p in law.items())
    dof = len(law) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2  # beyond p = 1e-6 for an exact sampler
    # 0.16: the 99.99th percentile of the TV of 300 exact draws from this law (2e5 simulated; median 0.086)
    assert 0.5 * sum(abs(counts.get(s, 0) / runs - p) for s, p in law.items()) < 0.16
    assert len(counts) > 4 and results["runs"][1]["temperature"] == 1.0


@pytest.mark.parametrize(
    "key, value",
    [
        ("n_prompts", "3"),
        ("target", "smollm2"),
        ("drafter", "x"),
        ("max_seq_len", "64"),
        ("batch_size", "2"),
        ("device", "cpu"),
        ("bench", "humaneval"),
        ("threads", "1"),
        ("warmup", "false"),
    ],
)
def test_a_run_level_key_in_a_variant_is_refused(key, value, tmp_path, capsys):
    label = f"sps@gamma=2@{key}={value}"
    with pytest.raises(OverrideError, match=f"'{key}' cannot differ per variant; set {key}={value} for the whole run"):
        evaluate_cli.parse_args([f"algorithms=[{label}]"])
    assert evaluate_cli.main([f"algorithms=[{label}]", f"out={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"algorithm variant '{label}'" in err and "\n" not in err


def test_a_variants_bad_sampling_is_refused_at_parse_time():
    with pytest.raises(OverrideError, match=r"variant 'sps@temperature=-1': temperature must be a finite number"):
        evaluate_cli.parse_args(["algorithms=[sps@temperature=-1]"])
    with pytest.raises(OverrideError, match=r"variant 'sps@max_new_tokens=0': max_new_tokens=0 must be >= 1"):
        evaluate_cli.parse_args(["algorithms=[sps@max_new_tokens=0]"])


def test_a_variants_max_new_tokens_takes_effect(tiny_eval, tmp_path):
    results, _ = tiny_eval(
        [[1, 2, 3], [4, 5]],
        16,
        ["algorithms=[sps@max_new_tokens=3]", "max_new_tokens=6", f"out={tmp_path}", "warmup=false"],
    )
    ar, short = results["runs"]
    assert (ar["new_tokens"], ar["max_new_tokens"]) == (12, 6)
    assert (short["new_tokens"], short["max_new_tokens"]) == (6, 3)
    assert short["greedy_equal_to_ar"] is True  # over its 3 tokens: AR's first 3
    assert "| greedy max 3 new |" in (tmp_path / "report.md").read_text()


def test_the_report_flags_every_greedy_row_that_left_ar():
    """Output that differs from AR's is never presented as lossless, whatever else the table says."""
    runs = [
        {
            "algorithm": name,
            "bench": "gsm",
            "n_prompts": 1,
            "new_tokens": 4,
            "tau": 2.0,
            "tokens_per_s": 9.0,
            "speedup_vs_ar": 1.2,
            "rollback_rate": 0.1,
            "greedy_equal_to_ar": equal,
            "temperature": 0,
        }
        for name, equal in (("ar", True), ("sps", True), ("eagle3_tree", False))
    ]
    exactness = {"path": "approximate", "probe": "not run", "bitwise": False, "reason": "cuda attention"}
    report = markdown_table({"config": {}, "runs": runs, "exactness": exactness})
    assert (
        "exactness: approximate path, probe not run (cuda attention); greedy output is AR's only up to rounding. **Not "
        "lossless: greedy output differs from AR's in eagle3_tree (gsm)**"
    ) in report


def test_batch_size_above_one_is_refused_where_it_would_leave_the_exact_path(monkeypatch, tmp_path):
    """Batched CPU rows are exact where the probe passed: batch_size=2 runs there. Where the probe left only one row
    exact (a host whose GEMM rows depend on the row count), it is refused in one line naming the fix. Where exact
    mode is off anyway (here the transformers fallback) batch_size=2 runs."""
    from inference.transformers_runner import TransformersRunner

    model = tiny_loaded(10, 16, 2, 3.0).model
    monkeypatch.setattr(
        evaluate_cli,
        "load_bench_prompts",
        lambda bench, tokenizer, n: evaluate_cli.BenchPrompts(bench, [[1, 2, 3], [4, 5]][:n]),
    )
    monkeypatch.setattr(evaluate_cli, "eos_token_ids", lambda *a, **k: [])
    cfg = evaluate_cli.parse_args(
        ["algorithms=[ar]", "batch_size=2", "n_prompts=2", "max_new_tokens=4", f"out={tmp_path}", "warmup=false"]
    )
    batched = ModelRunner.from_hf_model(model, max_batch_size=2, max_seq_len=32)
    assert batched.exactness.path == exactness.EXACT
    results = evaluate_cli.evaluate(cfg, target=LoadedModel("tiny", batched, None, model))
    assert results["exactness"]["path"] == exactness.EXACT and results["runs"][0]["new_tokens"] == 8
    batched.exactness = exactness.approximate(exactness.BATCHED_ROWS)  # what such a host's probe leaves
    with pytest.raises(ValueError) as refused:
        evaluate_cli.evaluate(cfg, target=LoadedModel("tiny", batched, None, model))
    message = str(refused.value)
    assert message.startswith("batch_size=2 serves 2 rows at once, and on this CPU batched rows leave the exact path")
    assert message.endswith("use batch_size=1 here") and "\n" not in message
    fallback = TransformersRunner(model, max_batch_size=2, max_seq_len=32)
    results = evaluate_cli.evaluate(cfg, target=LoadedModel("tiny", fallback, None, model))
    assert results["exactness"]["reason"].startswith("transformers backend") and results["runs"][0]["new_tokens"] == 8
    assert (
        "exactness: approximate path, probe not run (transformers backend: its attention and GEMMs compute a "
        "verification's rows together; exact mode needs the native runner"
    ) in (tmp_path / "report.md").read_text()
