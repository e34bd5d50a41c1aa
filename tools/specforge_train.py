#!/usr/bin/env python
"""Train with SpecForge 0.2.0's own command line, with the drafter's exact tau measured while it trains.

    python tools/specforge_train.py --states cached_states/qwen36-27b-v1 --every-n-train-steps 500 \
        [--keep-best-by-tau] [--eval-config eval.yaml] -- --config run.yaml [section.field=value ...]

Everything after -- is `specforge train`'s own arguments; several ranks: torchrun --nproc_per_node N
tools/specforge_train.py ... (docs/training-loops.md, "SpecForge").
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_cb.common.cli import run  # noqa: E402
from dflash_cb.integrations.specforge_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(main))
