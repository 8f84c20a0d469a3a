"""Running ``data_prep.extract`` from its command-line arguments."""

from __future__ import annotations

from data_prep.extract import extract, parse_args


def run_extract(argv: list[str]) -> dict:
    return extract(parse_args(argv))
