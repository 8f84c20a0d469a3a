"""Multi-stage jobs (``make demo``, ``benchmarks/drafter_quality.py``): each stage is one of the project's own
commands, printed before it runs, so any stage can be re-run by hand. A stage whose output is complete is skipped,
and the commands themselves resume (regeneration, extraction and training continue where a kill left them), so
re-running a pipeline after an interruption continues instead of starting over.

Consecutive stages that name the same ``group`` run side by side, one process each (on a 2-core CPU two
one-thread trainings finish sooner than one after the other with two threads each).

Each stage's minutes are those of the reference machine; ``pace`` (this host's minutes per reference minute, from a
probe timed before the first stage) scales them when they are announced. As stages finish, the pace becomes the one
they actually ran at (their wall minutes over their reference minutes), and the minutes left are announced again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError


POLL_S = 1.0  # how often side-by-side stages are checked for their end


@dataclass(frozen=True)
class Stage:
    name: str
    minutes: float  # expected minutes on the reference machine (one thread per stage); scaled by the host's pace
    what: str
    argv: tuple[str, ...]  # arguments of `python -m ...`
    output: Path
    marker: Path  # written when the stage's command succeeded: a killed stage leaves none and resumes
    group: str = ""  # consecutive stages with the same non-empty group run concurrently

    def done(self) -> bool:
        return self.marker.is_file() and self.output.exists()

    def mark_done(self, minutes: float = 0.0, announced: float | None = None) -> None:
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        record = {"argv": list(self.argv), "minutes": round(minutes, 2)}
        if announced is not None:
            record["announced_minutes"] = round(announced, 2)
        self.marker.write_text(json.dumps(record) + "\n")

    def _recorded(self, key: str) -> float | None:
        try:
            return float(json.loads(self.marker.read_text())[key])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def measured_minutes(self) -> float | None:
        """The wall minutes its finished run took (None for markers written before minutes were recorded)."""
        return self._recorded("minutes")

    def announced_minutes(self) -> float | None:
        """The minutes announced before its run, at the pace of that moment (None where not recorded)."""
        return self._recorded("announced_minutes")


def select(stages: Sequence[Stage], names: Sequence[str]) -> list[Stage]:
    """The stages ``names`` asks for ("all" = every stage), in pipeline order; unknown names fail in one line."""
    unknown = set(names) - {"all"} - {s.name for s in stages}
    if unknown:
        raise UserError(f"unknown stage(s) {sorted(unknown)}; stages: {', '.join(s.name for s in stages)}")
    return [s for s in stages if "all" in names or s.name in names]


def _batches(stages: Sequence[Stage]) -> list[list[Stage]]:
    batches: list[list[Stage]] = []
    for stage in stages:
        if batches and stage.group and batches[-1][0].group == stage.group:
            batches[-1].append(stage)
        else:
            batches.append([stage])
    return batches


def minutes_left(stages: Sequence[Stage], pace: float = 1.0) -> float:
    """Expected minutes of the stages not done yet at ``pace`` (this host's minutes per reference minute);
    side-by-side stages overlap, so a group takes as long as its longest stage still to run."""
    return pace * sum(max((s.minutes for s in batch if not s.done()), default=0.0) for batch in _batches(stages))


def measured_pace(finished: Sequence[tuple[float, float]], probed: float) -> float:
    """This host's minutes per reference minute: over the stages finished so far (reference minutes, wall
    minutes), their wall minutes over their reference minutes; the probe's figure until a stage has finished."""
    reference = sum(ref for ref, _ in finished)
    return sum(wall for _, wall in finished) / reference if reference > 0 else probed


def stage_minutes(stages: Sequence[Stage]) -> list[dict[str, object]]:
    """Per finished stage: its reference, announced and measured wall minutes (what a run writes beside its
    results, so its timings are checkable)."""
    return [
        {
            "stage": s.name,
            "group": s.group,
            "reference_minutes": round(s.minutes, 2),
            "announced_minutes": s.announced_minutes(),
            "minutes": s.measured_minutes(),
        }
        for s in stages
        if s.done()
    ]


def run_pipeline(
    stages: Sequence[Stage],
    *,
    label: str,
    rerun_hint: str,
    env: dict[str, str] | None = None,
    pace: float = 1.0,
    pace_note: str = "",
) -> list[str]:
    """Run every stage not done yet; returns the names of those that ran. ``pace`` scales the stages' reference
    minutes to this host (``pace_note`` says where it comes from), then the pace the finished stages ran at does.
    A failure raises one line naming the stage (finished ones are kept)."""
    todo = [s for s in stages if not s.done()]
    where = f"on this host ({pace_note})" if pace_note else "on a 2-core CPU"
    print(
        f"[{label}] {len(stages)} stages, {len(stages) - len(todo)} already done; about "
        f"{minutes_left(stages, pace):.0f} min of work left {where}.",
        flush=True,
    )
    probed, finished = pace, []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), **(env or {})}
    index = {id(s): i for i, s in enumerate(stages, 1)}
    ran: list[str] = []
    for batch in _batches(stages):
        running = []
        for stage in batch:
            head = f"[{label}] stage {index[id(stage)]}/{len(stages)} {stage.name}"
            if stage.done():
                print(f"{head}: done already ({stage.output}), skipped", flush=True)
                continue
            side = " (alongside the next stage)" if len(batch) > 1 else ""
            print(
                f"{head}: {stage.what} (about {pace * stage.minutes:.1f} min){side}\n[{label}]   $ python -m "
                f"{' '.join(stage.argv)}",
                flush=True,
            )
            running.append(
                (stage, head, time.perf_counter(), subprocess.Popen([sys.executable, "-m", *stage.argv], env=env))
            )
        failed = []
        while running:  # as each ends (not in start order), so each stage's minutes are its own
            for item in [r for r in running if r[3].poll() is not None]:
                running.remove(item)
                stage, head, start, process = item
                if process.returncode != 0 or not stage.output.exists():
                    failed.append(stage.name)
                    continue
                minutes = (time.perf_counter() - start) / 60
                stage.mark_done(minutes, pace * stage.minutes)
                ran.append(stage.name)
                finished.append((stage.minutes, minutes))
                print(f"{head}: finished in {minutes:.1f} min (announced {pace * stage.minutes:.1f})", flush=True)
            if running:
                time.sleep(POLL_S)
        if failed:
            raise UserError(
                f"{label} stage {', '.join(failed)} failed (its error is above); fix it and re-run "
                f"{rerun_hint}: finished stages are kept and this one resumes"
            )
        if finished and any(not s.done() for s in stages):
            pace = measured_pace(finished, probed)
            print(
                f"[{label}] the stages run so far took {pace:.2f}x their reference minutes: about "
                f"{minutes_left(stages, pace):.0f} min of work left at that pace.",
                flush=True,
            )
    return ran
