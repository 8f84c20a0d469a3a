"""Each algorithm's options: declared once, in its own dataclass, which the algorithm takes whole; read on the CLIs
under the algorithm's name (``ssd.budget=8``, in a variant ``ssd@budget=8``; the flat spellings of the previous
release with a warning); and refused (one line) by every CLI when the chosen algorithms do not read them."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from core.overrides import OverrideError
from inference import evaluate as evaluate_cli
from inference import generate as generate_cli
from inference.algorithms import ALGORITHMS, algorithm_class
from inference.algorithms.options import OPTIONS_BY_ALGORITHM, AlgorithmOptions, SSDOptions, option_keys, with_fields
from inference.engine_args import with_overrides
from inference.serve.config import parse_args as serve_args
from spectrain.adapt.adapter import AdaptSettings


def test_every_algorithm_has_its_own_options_section():
    assert set(OPTIONS_BY_ALGORITHM) == set(ALGORITHMS)
    sections = {f.name: f.default_factory for f in fields(AlgorithmOptions) if f.name in ALGORITHMS}
    assert sections == OPTIONS_BY_ALGORITHM
    assert option_keys("ar") == []
    assert "tree_depth" in option_keys("eagle3_tree") and "tree_depth" not in option_keys("specblock_tree")
    assert set(option_keys("pearl")) == {"gamma", "draft_vocab", "executor"}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_an_algorithm_takes_its_options_dataclass_and_states_no_default_of_its_own(name):
    cls = algorithm_class(name)
    parameters = inspect.signature(cls.__init__).parameters
    assert parameters["options"].default is None  # None: the dataclass's defaults
    redeclared = set(parameters) & set(option_keys(name))
    assert not redeclared, f"{name}'s constructor declares {sorted(redeclared)} again"
    assert not hasattr(cls, "options_from_config")


def test_options_given_whole_or_as_fields_are_the_same_and_unknown_fields_fail():
    assert with_fields(SSDOptions, None, {"budget": 4}) == SSDOptions(budget=4)
    assert with_fields(SSDOptions, SSDOptions(gamma=3), {"budget": 4}) == SSDOptions(gamma=3, budget=4)
    with pytest.raises(TypeError, match="^SSDOptions has no option ssd_budget; its options: executor, gamma, "):
        with_fields(SSDOptions, None, {"ssd_budget": 4})


def test_keys_are_scoped_by_algorithm_and_a_variant_names_its_own(tmp_path, capsys):
    cfg = evaluate_cli.parse_args(
        [
            "algorithms=[ssd,ssd@budget=4@fallback=fast,specblock_tree]",
            "ssd.budget=16",
            "specblock_tree.budget=20",
            f"out={tmp_path}",
        ]
    )
    assert (cfg.ssd.budget, cfg.specblock_tree.budget, cfg.ssd.fallback) == (16, 20, "jit")
    variant = with_overrides(cfg, ["budget=4", "fallback=fast"], "ssd@budget=4@fallback=fast")
    assert (variant.ssd.budget, variant.ssd.fallback, variant.specblock_tree.budget) == (4, "fast", 20)
    assert capsys.readouterr().err == ""  # no old spelling, no warning
    with pytest.raises(
        OverrideError, match="^key 'budget' is ambiguous: write one of ssd.budget, specblock_tree.budget"
    ):
        evaluate_cli.parse_args(["algorithms=[ssd]", "budget=16", f"out={tmp_path}"])
    with pytest.raises(OverrideError, match=r"^unknown key 'ssd\.nope'"):
        evaluate_cli.parse_args(["algorithms=[ssd]", "ssd.nope=1", f"out={tmp_path}"])


def test_the_old_flat_spellings_work_for_one_release_with_a_one_line_warning(tmp_path, capsys):
    cfg = evaluate_cli.parse_args(
        ["algorithms=[sps,ssd@ssd_fallback=fast]", "ssd_budget=16", "gamma=3", f"out={tmp_path}"]
    )
    assert (cfg.ssd.budget, cfg.sps.gamma, cfg.ssd.gamma) == (16, 3, 3)
    assert with_overrides(cfg, ["ssd_fallback=fast"], "ssd@ssd_fallback=fast").ssd.fallback == "fast"
    note = "(options are scoped by algorithm; the old spelling is accepted until the next release)"
    warnings = capsys.readouterr().err.splitlines()
    assert warnings[0] == f"warning: ssd_budget=16 is the old spelling; write ssd.budget=16 {note}"
    assert warnings[1] == (
        f"warning: gamma=3 is the old spelling; write sps.gamma=3 pearl.gamma=3 specbranch.gamma=3 ssd.gamma=3 {note}"
    )
    assert warnings[2] == (
        f"warning: algorithm variant 'ssd@ssd_fallback=fast': ssd_fallback=fast is the old "
        f"spelling; write fallback=fast {note}"
    )
    cfg = serve_args(["algorithm=self_draft", "self_draft_L=4", "ngram_corpus=c.pt"])
    assert (cfg.self_draft.branch_len, cfg.self_draft.corpus) == (4, "c.pt")
    assert "write self_draft.branch_len=4 " in capsys.readouterr().err


def test_the_adapters_settings_pass_through_as_written_and_the_adapter_parses_them():
    cfg = serve_args(
        [
            "algorithm=eagle3_tree",
            "adapt=bandit",
            "adapt.horizon=7",
            "adapt.validate=false",
            "adapt.log=null",
            "adapt_min_gap=2",
        ]
    )
    assert dict(cfg.adapt_settings) == {"horizon": "7", "validate": "false", "log": "null", "min_gap": "2"}
    assert AdaptSettings.from_given(dict(cfg.adapt_settings)) == AdaptSettings(
        horizon=7, validate=False, log=None, min_gap=2
    )
    with pytest.raises(OverrideError, match="^adapt.nope is not a setting of adapt=bandit; its settings: arms, "):
        serve_args(["algorithm=eagle3_tree", "adapt=bandit", "adapt.nope=1"])
    with pytest.raises(OverrideError, match="^bad setting adapt.horizon: "):
        serve_args(["algorithm=eagle3_tree", "adapt=bandit", "adapt.horizon=soon"])


def test_evaluate_refuses_an_option_no_algorithm_of_the_run_reads(tmp_path):
    with pytest.raises(OverrideError) as exc:
        evaluate_cli.parse_args(["algorithms=[sps]", "eagle3_tree.tree_depth=3", f"out={tmp_path}"])
    assert str(exc.value) == (
        "eagle3_tree.tree_depth is not read by sps (sps reads gamma, draft_vocab, verifier, final_ratio); it is an "
        "option of eagle3_tree: drop it or choose an algorithm that reads it"
    )
    # read by one algorithm of the run: fine; and `all` admits every option
    evaluate_cli.parse_args(["algorithms=[sps,eagle3_tree]", "eagle3_tree.tree_depth=3", f"out={tmp_path}"])
    evaluate_cli.parse_args(["algorithms=all", "eagle3_tree.tree_depth=3", "ssd.budget=4", f"out={tmp_path}"])


def test_a_variant_may_set_only_its_own_algorithms_options(tmp_path):
    with pytest.raises(OverrideError, match=r"^algorithm variant 'sps@tree_topk=2': tree_topk is not read by sps "):
        evaluate_cli.parse_args(["algorithms=[sps@tree_topk=2,eagle3_tree]", f"out={tmp_path}"])
    with pytest.raises(OverrideError, match=r"^algorithm variant 'sps@ssd.budget=2': ssd.budget is not read by sps "):
        evaluate_cli.parse_args(["algorithms=[sps@ssd.budget=2]", f"out={tmp_path}"])
    cfg = evaluate_cli.parse_args(["algorithms=[eagle3_tree@tree_topk=2]", f"out={tmp_path}"])
    assert cfg.algorithms == ["eagle3_tree@tree_topk=2"]


def test_an_option_that_does_nothing_with_the_others_is_refused(tmp_path):
    with pytest.raises(OverrideError) as exc:
        evaluate_cli.parse_args(["algorithms=[eagle3_tree]", "adapt.horizon=7", f"out={tmp_path}"])
    assert str(exc.value) == (
        "adapt.horizon does nothing with adapt=none; set adapt=NAME (e.g. adapt=bandit) or drop adapt.horizon"
    )
    with pytest.raises(
        OverrideError,
        match=r"^sps\.final_ratio does nothing with sps\.verifier=tokenwise; set "
        r"sps\.verifier=hsd",
    ):
        evaluate_cli.parse_args(["algorithms=[sps]", "sps.final_ratio=uncapped", f"out={tmp_path}"])
    # a run-level adapter setting that one variant's adapter uses is read
    evaluate_cli.parse_args(["algorithms=[eagle3_tree@adapt=bandit]", "adapt.horizon=7", f"out={tmp_path}"])
    evaluate_cli.parse_args(["algorithms=[sps@verifier=hsd@final_ratio=uncapped]", f"out={tmp_path}"])


def test_serve_refuses_options_its_algorithm_does_not_read():
    with pytest.raises(OverrideError) as exc:
        serve_args(
            ["algorithm=ar", "adapt=bandit", "eagle3_tree.tree_depth=3", "pearl.executor=multiprocess", "seed=5"]
        )
    assert str(exc.value) == (
        "adapt is not read by ar (ar reads no algorithm option); it is an option of "
        "eagle3_tree, specblock_tree: drop it or choose an algorithm that reads it"
    )
    with pytest.raises(OverrideError, match="^algorithm variant 'sps@ssd_budget=4': ssd_budget is not read by sps"):
        serve_args(["algorithm=sps@ssd_budget=4"])  # the old spelling: warned, then refused as before
    cfg = serve_args(["algorithm=sps@gamma=3", "seed=5", "temperature=0.5"])  # sampling: read by every algorithm
    assert cfg.seed == 5


def test_generate_refuses_options_its_algorithm_does_not_read(capsys):
    assert generate_cli.main(["prompt=hi", "algorithm=ar", "gamma=3"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "gamma is not read by ar (ar reads no algorithm option); it is an option of sps, pearl, specbranch, ssd: "
            "drop it or choose an algorithm that reads it"
        )
    )
    assert generate_cli.main(["prompt=hi", "max_new_tokens=-1"]) == 2
    assert "max_new_tokens=-1 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key, value", [("device", "cpu"), ("threads", "1"), ("target", "smollm2"), ("chat_template", "none")]
)
def test_a_variant_may_not_change_what_is_fixed_for_the_run(key, value, tmp_path):
    with pytest.raises(OverrideError, match=f"'{key}' cannot differ per variant; set {key}={value} for the whole run"):
        evaluate_cli.parse_args([f"algorithms=[sps@{key}={value}]", f"out={tmp_path}"])


@pytest.mark.parametrize(
    "item, spelled",
    [("drafter.eagle3=exports/a", "drafter.eagle3"), ("feature_drafter=exports/a", "drafter.eagle3")],
)
def test_a_variant_may_not_change_a_drafter_of_one_kind(item, spelled, tmp_path):
    """Drafters load once for the whole run: a variant's drafter.KIND= is refused as such, not as an unknown key."""
    with pytest.raises(
        OverrideError, match=f"'{spelled}' cannot differ per variant; set {spelled}=exports/a for the whole"
    ):
        evaluate_cli.parse_args([f"algorithms=[eagle3_tree@{item}]", f"out={tmp_path}"])


def test_help_shows_the_keys_as_written_not_internal_fields(capsys):
    assert generate_cli.main(["--help"]) == 0
    keys = capsys.readouterr().out.split("keys: ", 1)[1]
    assert "drafter.KIND" in keys and "adapt.NAME" in keys
    assert "drafter_by_kind" not in keys and "adapt_settings" not in keys
