"""The argument parser of each stage ``make demo`` runs, by module."""

from __future__ import annotations

import importlib

from core.overrides import parse_cli

PARSERS = {  # module -> how that CLI validates its arguments without doing the work
    "data_prep.regenerate": lambda argv: importlib.import_module("data_prep.regenerate").parse_args(argv),
    "data_prep.traces": lambda argv: importlib.import_module("data_prep.traces").parse_args(argv),
    "spectrain.export": lambda argv: importlib.import_module("spectrain.export").parse_args(argv),
    "inference.evaluate": lambda argv: importlib.import_module("inference.evaluate").parse_args(argv),
    "spectrain.fit": lambda argv: importlib.import_module("spectrain.fit").compose_recipe(argv),
    "data_prep.ngram_corpus": lambda argv: parse_cli(
        argv, importlib.import_module("data_prep.ngram_corpus").NgramCorpusConfig, "usage"
    ),
}
