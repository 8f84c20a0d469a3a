"""The knobs every algorithm reads, shared by ``inference.evaluate`` and ``inference.generate``.

Each algorithm's ``options_from_config(cfg)`` picks its own fields from a config built on this dataclass, so a
new algorithm adds its fields here once and both CLIs accept them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlgorithmOptions:
    # sps (and other chain algorithms)
    verifier: str = "tokenwise"  # tokenwise | block | hsd
    hsd_final_ratio: str = "capped"  # capped (lossless) | uncapped (the HSD authors' lossy rule)
    gamma: int = 4
    # eagle3_tree
    tree_depth: int = 6  # longest drafted path
    tree_topk: int = 8  # children per expanded node, and nodes expanded per level
    tree_total: int = 48  # tokens per verification forward, root included
    # self_draft
    self_draft_L: int = 6  # branch length L (draft levels per branch = L - 2)
    self_draft_N: int = 6  # number of draft branches N
    self_draft_G: int = 4  # context gram length G (capped at L - 1)
    self_draft_candidates: int = 10  # context-cache candidates per step
    self_draft_verify_branches: bool = True  # also accept tokens from the branches (lossless)
    ngram_corpus: str | None = None  # corpus cache file from python -m data_prep.ngram_corpus
    compat_original_cap: bool = False  # the original's counting (no bonus token), for the paper's DE
    # sampling and placement
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str = "auto"
    max_seq_len: int = 2048
    threads: int = 0  # CPU intra-op threads; 0 = torch's default (on a shared CPU, 1 keeps timings sane)


def apply_threads(cfg) -> None:
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
