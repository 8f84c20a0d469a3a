"""Each algorithm's options: declared in its own dataclass, read only from there, and refused (one line) by every
CLI when the chosen algorithms do not read them."""

from __future__ import annotations

from dataclasses import fields

import pytest
from omegaconf import OmegaConf

from core.overrides import OverrideError
from inference import evaluate as evaluate_cli
from inference import generate as generate_cli
from inference.algorithms import ALGORITHMS, algorithm_class
from inference.algorithms.options import (ALGORITHM_KEYS, OPTIONS_BY_ALGORITHM, PlacementOptions, SamplingOptions,
                                          option_keys)
from inference.engine_args import EngineArgs
from inference.serve.config import parse_args as serve_args

# keys every algorithm may read besides its own: sampling, placement, and the models (a draft process reloads the
# drafter from its path; Self-Draft's corpus cache checks the target's tokenizer)
SHARED = ({f.name for f in fields(SamplingOptions)} | {f.name for f in fields(PlacementOptions)}
          | {"target", "drafter"})


class RecordingConfig:
    """A config that records which keys are read."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, key):
        self.read.add(key)
        return getattr(self._cfg, key)


def test_every_algorithm_has_its_own_options():
    assert set(OPTIONS_BY_ALGORITHM) == set(ALGORITHMS)
    assert option_keys("ar") == []
    assert "tree_depth" in option_keys("eagle3_tree") and "tree_depth" not in option_keys("specblock_tree")
    assert set(option_keys("pearl")) == {"gamma", "draft_vocab", "executor"}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_an_algorithm_reads_only_its_declared_options(name):
    # adaptation on, so the adapter's settings are read too; no corpus (loading one needs a file)
    cfg = RecordingConfig(OmegaConf.structured(EngineArgs(adapt="bandit", verifier="hsd")))
    algorithm_class(name).options_from_config(cfg)
    undeclared = cfg.read - set(option_keys(name)) - SHARED
    assert not undeclared, f"{name} reads {sorted(undeclared)} without declaring them"
    assert cfg.read & ALGORITHM_KEYS <= set(option_keys(name))


def test_evaluate_refuses_an_option_no_algorithm_of_the_run_reads(tmp_path):
    with pytest.raises(OverrideError) as exc:
        evaluate_cli.parse_args(["algorithms=[sps]", "tree_depth=3", f"out={tmp_path}"])
    assert str(exc.value) == (
        "tree_depth is not read by sps (sps reads gamma, draft_vocab, verifier, hsd_final_ratio); it is an option "
        "of eagle3_tree: drop it or choose an algorithm that reads it")
    # read by one algorithm of the run: fine; and `all` admits every option
    evaluate_cli.parse_args(["algorithms=[sps,eagle3_tree]", "tree_depth=3", f"out={tmp_path}"])
    evaluate_cli.parse_args(["algorithms=all", "tree_depth=3", "ssd_budget=4", f"out={tmp_path}"])


def test_a_variant_may_set_only_its_own_algorithms_options(tmp_path):
    with pytest.raises(OverrideError, match=r"^algorithm variant 'sps@tree_topk=2': tree_topk is not read by sps "):
        evaluate_cli.parse_args(["algorithms=[sps@tree_topk=2,eagle3_tree]", f"out={tmp_path}"])
    cfg = evaluate_cli.parse_args(["algorithms=[eagle3_tree@tree_topk=2]", f"out={tmp_path}"])
    assert cfg.algorithms == ["eagle3_tree@tree_topk=2"]


def test_an_option_that_does_nothing_with_the_others_is_refused(tmp_path):
    with pytest.raises(OverrideError) as exc:
        evaluate_cli.parse_args(["algorithms=[eagle3_tree]", "adapt_horizon=7", f"out={tmp_path}"])
    assert str(exc.value) == "adapt_horizon does nothing with adapt=none; set adapt other than none or drop adapt_horizon"
    with pytest.raises(OverrideError, match="^hsd_final_ratio does nothing with verifier=tokenwise; set verifier=hsd"):
        evaluate_cli.parse_args(["algorithms=[sps]", "hsd_final_ratio=uncapped", f"out={tmp_path}"])
    # a run-level adapter setting that one variant's adapter uses is read
    evaluate_cli.parse_args(["algorithms=[eagle3_tree@adapt=bandit]", "adapt_horizon=7", f"out={tmp_path}"])
    evaluate_cli.parse_args(["algorithms=[sps@verifier=hsd@hsd_final_ratio=uncapped]", f"out={tmp_path}"])


def test_serve_refuses_options_its_algorithm_does_not_read():
    with pytest.raises(OverrideError) as exc:
        serve_args(["algorithm=ar", "adapt=bandit", "tree_depth=3", "executor=multiprocess", "seed=5"])
    assert str(exc.value) == ("adapt is not read by ar (ar reads no algorithm option); it is an option of "
                              "eagle3_tree, specblock_tree: drop it or choose an algorithm that reads it")
    with pytest.raises(OverrideError, match="^algorithm variant 'sps@ssd_budget=4': ssd_budget is not read by sps"):
        serve_args(["algorithm=sps@ssd_budget=4"])
    cfg = serve_args(["algorithm=sps@gamma=3", "seed=5", "temperature=0.5"])  # sampling: read by every algorithm
    assert cfg.seed == 5


def test_generate_refuses_options_its_algorithm_does_not_read(capsys):
    assert generate_cli.main(["prompt=hi", "algorithm=ar", "gamma=3"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "gamma is not read by ar (ar reads no algorithm option); it is an option of sps, pearl, specbranch, ssd: "
        "drop it or choose an algorithm that reads it")
    assert generate_cli.main(["prompt=hi", "max_new_tokens=-1"]) == 2
    assert "max_new_tokens=-1 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("key, value", [("device", "cpu"), ("threads", "1"), ("target", "smollm2"),
                                        ("chat_template", "none")])
def test_a_variant_may_not_change_what_is_fixed_for_the_run(key, value, tmp_path):
    with pytest.raises(OverrideError, match=f"'{key}' cannot differ per variant; set {key}={value} for the whole run"):
        evaluate_cli.parse_args([f"algorithms=[sps@{key}={value}]", f"out={tmp_path}"])
