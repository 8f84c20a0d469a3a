"""Several command-line runs in one launch: ``python tests/run_many.py RUNS.json``, RUNS.json being a list of
``[module, args]`` pairs, each run as ``python -m module *args`` runs it (its ``main(args)``), in order.

Under a launcher that starts several processes (Lightning's own for ``spectrain.fit ... trainer.devices=N``, which
re-runs this very command; or torchrun), every process runs the same runs in the same order: the process group the
first fit starts serves the rest (Lightning never destroys it before exit), and ``data_prep``'s processes meet only
through files. Tests launch several runs this way for the price of one interpreter start per process: most of a
small multi-process run is the start of its interpreters.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def main(runs_file: str) -> int:
    for module, args in json.loads(Path(runs_file).read_text()):
        code = importlib.import_module(module).main(args)
        if code:  # every process fails the same way (one line each); the later runs would not start anyway
            print(f"[run_many] failed: python -m {module} {' '.join(args)}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
