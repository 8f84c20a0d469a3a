"""One served query as the adapter sees it, and the on-disk trace format (``adapt.log=DIR``) replay reads.

A :class:`QueryRecord` holds what verification gave for free:

- ``tokens`` [L + 1]: the committed sequence (prompt, then every verified row) plus the last emitted token
  (emitted but never verified);
- ``features`` [L, F]: the target's features (EAGLE-3: aux layers concatenated) at every committed position;
- ``teacher`` [L - P + 1, Vd]: the target's logits over the DRAFT vocabulary at positions ``P - 1 .. L - 1``
  (the last prompt position from prefill, then each verified row), ``in_vocab`` [L - P + 1] whether the target's
  argmax is in the draft vocabulary (EAGLE-3's position mask);
- the per-query signal inputs: ``rejection_q`` (drafter probability of the target's token at each rejected
  position), ``accepted`` (accepted draft tokens per verification round), ``decode_s`` (the rounds' seconds:
  each round's share of its engine step, without any update), ``max_accept`` (the longest possible accept length
  per round, tree depth + 1).

Trace directory (written by the engine hook when ``adapt.log=DIR``; read by ``python -m spectrain.adapt.replay``)::

    DIR/manifest.json          {"format": "spectrain-adapt-trace", "version": 1, "costs": {...}, "settings": {...}}
    DIR/queries/q00000.pt      torch.save of QueryRecord.to_dict() (fp16 features / teacher), one per query
    DIR/decisions.csv          one row per query: signal, context, τ, chosen arm, expected and realised reward
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.errors import UserError

TRACE_FORMAT, TRACE_VERSION = "spectrain-adapt-trace", 1


@dataclass
class QueryRecord:
    prompt_len: int
    tokens: torch.Tensor  # [L + 1] long
    features: torch.Tensor  # [L, F]
    teacher: torch.Tensor  # [L - P + 1, Vd]
    in_vocab: torch.Tensor  # [L - P + 1] bool
    rejection_q: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    decode_s: float = 0.0
    max_accept: int = 1

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean accept length per verification round (accepted draft tokens + the bonus token)."""
        return (sum(self.accepted) + self.rounds) / max(self.rounds, 1)

    @property
    def num_rows(self) -> int:
        return int(self.features.shape[0])

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.update(features=self.features.half(), teacher=self.teacher.half())  # halves the trace size
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> QueryRecord:
        values = dict(values)
        values.update(features=values["features"].float(), teacher=values["teacher"].float())
        return cls(**values)


class QueryRecorder:
    """Collects one query's rows while the engine runs (the engine hook's buffer)."""

    def __init__(
        self,
        prompt_ids: list[int],
        features: torch.Tensor,
        teacher: torch.Tensor,
        in_vocab: torch.Tensor,
        max_accept: int,
    ):
        self.prompt_len = len(prompt_ids)
        self.tokens = list(prompt_ids)
        self.features, self.teacher, self.in_vocab = [features.detach()], [teacher.detach()], [in_vocab.detach()]
        self.rejection_q: list[float] = []
        self.accepted: list[int] = []
        self.max_accept = max_accept
        self.decode_s = 0.0  # the rounds' seconds, as the engine charged them

    def add_round(
        self,
        tokens: list[int],
        features: torch.Tensor,
        teacher: torch.Tensor,
        in_vocab: torch.Tensor,
        accepted: int,
        rejection_q: float | None,
        seconds: float,
    ) -> None:
        """``tokens`` committed this round (root + accepted path) with their features and teacher rows; the round
        cost ``seconds`` (the query's share of the engine step, ``inference.round_observers``)."""
        self.decode_s += seconds
        self.tokens += tokens
        self.features.append(features.detach())
        self.teacher.append(teacher.detach())
        self.in_vocab.append(in_vocab.detach())
        self.accepted.append(int(accepted))
        if rejection_q is not None:
            self.rejection_q.append(float(rejection_q))

    def finish(self, last_token: int) -> QueryRecord:
        return QueryRecord(
            prompt_len=self.prompt_len,
            tokens=torch.tensor(self.tokens + [int(last_token)], dtype=torch.long),
            features=torch.cat(self.features).float().cpu(),
            teacher=torch.cat(self.teacher).float().cpu(),
            in_vocab=torch.cat(self.in_vocab).bool().cpu(),
            rejection_q=self.rejection_q,
            accepted=self.accepted,
            decode_s=self.decode_s,
            max_accept=self.max_accept,
        )


def write_manifest(directory: Path, payload: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "queries").mkdir(exist_ok=True)
    manifest = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **payload}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")


def write_record(directory: Path, index: int, record: QueryRecord) -> Path:
    path = directory / "queries" / f"q{index:05d}.pt"
    torch.save(record.to_dict(), path)
    return path


def read_trace(directory: str | Path) -> tuple[dict[str, Any], list[QueryRecord]]:
    """(manifest, records in query order) of an ``adapt.log`` directory; one-line errors for anything else."""
    directory = Path(directory)
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"traces={directory} has no manifest.json: record traces with adapt=bandit "
            "adapt.log=DIR on eagle3_tree first"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != TRACE_FORMAT or manifest.get("version") != TRACE_VERSION:
        raise UserError(
            f"{manifest_path} is not a {TRACE_FORMAT} v{TRACE_VERSION} manifest (got "
            f"{manifest.get('format')} v{manifest.get('version')}); re-record the traces"
        )
    paths = sorted((directory / "queries").glob("q*.pt"))
    if not paths:
        raise UserError(f"traces={directory} holds no queries/q*.pt records; the recorded run served no query")
    records = [QueryRecord.from_dict(torch.load(p, map_location="cpu", weights_only=True)) for p in paths]
    return manifest, records
