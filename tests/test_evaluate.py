"""The evaluation and generation CLIs: results schema, AR baseline in the same run, one-line errors."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from inference import evaluate as evaluate_cli
from inference import generate as generate_cli
from inference.drafters import LoadedModel, load_draft_lm
from spectrain.overrides import OverrideError
from inference.runner import ModelRunner


def loaded(smollm2, max_seq_len: int = 512) -> LoadedModel:
    model, tokenizer = smollm2
    # A fresh runner shares the model's weights but owns its KV cache, so target and draft can be one model.
    return LoadedModel("smollm2", ModelRunner.from_hf_model(model, max_seq_len=max_seq_len), tokenizer, model)


@pytest.mark.real_model
def test_evaluate_writes_results_with_same_run_ar_baseline(smollm2, tmp_path):
    cfg = evaluate_cli.parse_args(["algorithms=sps", "drafter=smollm2", "bench=mt_bench", "n_prompts=1",
                                   "max_new_tokens=16", "gamma=4", "verifier=hsd", f"out={tmp_path}", "warmup=false"])
    results = evaluate_cli.evaluate(cfg, target=loaded(smollm2), draft=loaded(smollm2))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["runs"] == results["runs"]
    ar, sps = results["runs"]
    assert (ar["algorithm"], sps["algorithm"]) == ("ar", "sps")
    expected_keys = {"algorithm", "bench", "n_prompts", "new_tokens", "wall_s", "tokens_per_s", "target_forwards",
                     "tau", "draft_forwards", "rollback_rate", "acceptance_by_position", "greedy_equal_to_ar"}
    assert expected_keys <= set(sps)
    assert sps["greedy_equal_to_ar"] is True and ar["greedy_equal_to_ar"] is True
    # the target drafting for itself accepts everything: 1 prefill token + 5 per round -> 16 tokens in 4 forwards
    assert sps["new_tokens"] == ar["new_tokens"] == 16
    assert sps["target_forwards"] == 4 and sps["tau"] == 4.0 and sps["rollback_rate"] == 0.0
    assert sps["acceptance_by_position"] == [1.0, 1.0, 1.0, 1.0]
    assert sps["accepted_hist"] == [0, 0, 0, 0, 3]  # three rounds kept all 4 drafted tokens
    assert set(results["speedup_vs_ar"]) == {"ar", "sps"} and results["speedup_vs_ar"]["ar"] == 1.0
    report = (tmp_path / "report.md").read_text()
    assert "| sps | mt_bench | 1 | 16 | 4.00 |" in report
    for png in ("acceptance.png", "speedup.png", "tau_distribution.png"):
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.parametrize("args, needle", [
    (["algorithms=[ar,nope]"], "unknown algorithm 'nope'; available: ar, sps"),
    (["algoritms=[ar]"], "unknown key 'algoritms' (did you mean 'algorithms'?)"),
    (["algorithms=[sps]", "n_prompts=1"], "'sps' needs a draft LM"),
    (["temperature=-1"], "temperature must be a finite number >= 0"),
    (["target=/no/such/model"], "unknown model '/no/such/model'"),
])
def test_evaluate_cli_errors_are_one_line(args, needle, capsys, tmp_path):
    assert evaluate_cli.main([*args, f"out={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_list_fields_accept_a_single_value():
    cfg = evaluate_cli.parse_args(["bench=humaneval", "algorithms=sps"])
    assert list(cfg.bench) == ["humaneval"] and list(cfg.algorithms) == ["sps"]
    assert OmegaConf.to_container(evaluate_cli.parse_args(["bench=[mt_bench,humaneval]"]).bench) == [
        "mt_bench", "humaneval"]


@pytest.mark.real_model
def test_prompt_longer_than_the_cache_is_one_line(smollm2, capsys, tmp_path):
    cfg = evaluate_cli.parse_args(["n_prompts=1", "max_new_tokens=64", "max_seq_len=64", f"out={tmp_path}"])
    with pytest.raises(ValueError, match=r"needs \d+ cache slots but max_seq_len=64; shorten the prompt"):
        evaluate_cli.evaluate(cfg, target=loaded(smollm2, max_seq_len=64))


@pytest.mark.real_model
def test_drafter_with_another_tokenizer_is_refused(smollm2, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = smollm2
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer) + 1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["<spectrain-extra-token>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has a different tokenizer than target 'smollm2'"):
        load_draft_lm(str(tmp_path), loaded(smollm2))


@pytest.mark.real_model
def test_generate_streams_the_answer(smollm2, capsys):
    cfg = generate_cli.parse_cli(["prompt=What is the capital of France?", "max_new_tokens=12"],
                                 generate_cli.GenerateConfig, generate_cli.USAGE)
    streamer = generate_cli.TextStreamer(smollm2[1])
    result = generate_cli.generate_text(cfg, loaded(smollm2), on_tokens=streamer)
    assert capsys.readouterr().out == "The capital of France is Paris."
    assert result.stats.new_tokens == 8  # the answer ends with <|im_end|>, an EOS of the chat template


@pytest.mark.real_model
def test_generate_with_a_vocabulary_limited_draft_gives_the_same_answer(smollm2, capsys):
    cfg = generate_cli.parse_cli(["prompt=What is the capital of France?", "max_new_tokens=12", "algorithm=sps",
                                  "draft_vocab=1000"], generate_cli.GenerateConfig, generate_cli.USAGE)
    streamer = generate_cli.TextStreamer(smollm2[1])
    result = generate_cli.generate_text(cfg, loaded(smollm2), loaded(smollm2), on_tokens=streamer)
    assert capsys.readouterr().out == "The capital of France is Paris."
    # the target drafting for itself accepts all 8 drafted tokens unlimited; 3575, 4649 and 7042 lie beyond id 1000
    assert 0 < result.stats.accepted_draft_tokens < result.stats.drafted_tokens


@pytest.mark.parametrize("name", ["ar", "sps", "eagle3_tree", "self_draft"])
def test_every_algorithm_reads_its_options_from_both_clis(name):
    from inference.algorithms import algorithm_class

    cls = algorithm_class(name)
    eval_cfg = evaluate_cli.parse_args(["gamma=3", "tree_depth=2", "self_draft_L=5"])
    gen_cfg = generate_cli.parse_cli(["prompt=hi", "gamma=3", "tree_depth=2", "self_draft_L=5"],
                                     generate_cli.GenerateConfig, generate_cli.USAGE)
    assert cls.options_from_config(eval_cfg) == cls.options_from_config(gen_cfg)


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
        "draft_lm": "draft_lm", "features": "eagle3", "specblock": "specblock", "hrad": "hrad"}
    other = _fake_export(tmp_path / "other_e3", "eagle3")
    cfg = evaluate_cli.parse_args([f"drafters={tmp_path / 'exports'}", f"drafter={other}"])
    assert evaluate_cli.drafter_paths(cfg)["features"] == str(other)  # drafter=PATH goes by the export's kind


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
    assert set(skipped) == {"eagle3_tree", "specblock_tree"} and "EAGLE-3 export" in skipped["eagle3_tree"]
    cfg = evaluate_cli.parse_args(["algorithms=[sps,eagle3_tree]"])
    with pytest.raises(OverrideError, match="'eagle3_tree' needs an EAGLE-3 export"):
        evaluate_cli.select_algorithms(cfg, {"draft_lm"})


@pytest.mark.parametrize("variant, needle", [
    ("sps@verifier", "'verifier' is not key=value"),
    ("sps@verifer=hsd", "unknown key 'verifer' (did you mean 'verifier'?)"),
    ("nope@gamma=2", "unknown algorithm 'nope'"),
])
def test_bad_variants_fail_before_loading(variant, needle, tmp_path, capsys):
    assert evaluate_cli.main([f"algorithms=[{variant}]", f"out={tmp_path}"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.real_model
def test_variants_run_side_by_side_with_their_own_options(smollm2, tmp_path):
    cfg = evaluate_cli.parse_args(["algorithms=[sps,sps@verifier=hsd@gamma=2,sps@draft_vocab=300]", "bench=mt_bench",
                                   "n_prompts=1", "max_new_tokens=12", "gamma=4", f"out={tmp_path}", "warmup=false"])
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

    base = {"bench": "mt_bench", "n_prompts": 1, "new_tokens": 8, "tau": 1.5, "tokens_per_s": 3.0,
            "speedup_vs_ar": 0.5, "rollback_rate": 0.9, "target_forwards": 4, "draft_forwards": 8,
            "greedy_equal_to_ar": True}
    runs = [dict(base, algorithm="sps"),
            dict(base, algorithm="ssd", cache_hit_rate=0.25, simulated_tokens_per_s=4.0),
            dict(base, algorithm="specbranch", rollback_rate_speculated=0.5, simulated_tokens_per_s=5.0,
                 executor="multiprocess")]
    rows = markdown_table({"config": {}, "runs": runs}).splitlines()
    assert rows[-3].endswith("| yes | – | – |")
    assert rows[-2].endswith("| yes | 4.0 | cache hit rate 0.25 |")
    assert rows[-1].endswith("| yes | 5.0 | rollback (speculated) 0.50; executor multiprocess |")


@pytest.mark.real_model
@pytest.mark.slow
def test_several_multiprocess_variants_run_in_one_evaluation(smollm2, tmp_path):
    """Each algorithm runs (and releases its draft process and process group) before the next, so two
    multiprocess variants fit in one run; results stay ordered by bench, then algorithm."""
    import torch.distributed as dist

    cfg = evaluate_cli.parse_args(["algorithms=[pearl@executor=multiprocess,specbranch@executor=multiprocess]",
                                   "drafter=smollm2", "hrad=none", "bench=[mt_bench,humaneval]", "n_prompts=1",
                                   "max_new_tokens=6", "gamma=2", "threads=1", f"out={tmp_path}", "warmup=false"])
    results = evaluate_cli.evaluate(cfg, target=loaded(smollm2), draft=loaded(smollm2))
    labels = [(r["bench"], r["algorithm"].split("@")[0]) for r in results["runs"]]
    assert labels == [(b, a) for b in ("mt_bench", "humaneval") for a in ("ar", "pearl", "specbranch")]
    overlapped = [r for r in results["runs"] if r["algorithm"] != "ar"]
    assert all(r["executor"] == "multiprocess" and r["greedy_equal_to_ar"] for r in overlapped)
    assert not dist.is_initialized()  # the last draft process was released too
