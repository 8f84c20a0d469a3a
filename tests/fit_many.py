"""Several ``python -m spectrain.fit`` runs in one launch: ``python tests/fit_many.py RUNS.json``, RUNS.json being a
list of argument lists (each as ``spectrain.fit`` takes them, ``trainer.devices=N`` included).

Lightning's launcher starts the other processes by re-running this very command, so every process runs the same
fits in the same order, and the process group the first fit starts serves the rest (Lightning never destroys it
before exit). Tests train several kinds under several strategies this way for the price of one interpreter launch
per process: most of a small multi-process run is the start of its interpreters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spectrain import fit


def main(runs_file: str) -> int:
    for args in json.loads(Path(runs_file).read_text()):
        code = fit.main(args)
        if code:  # every process fails the same way (one line each); the later runs would not start anyway
            print(f"[fit_many] failed: {' '.join(args)}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
