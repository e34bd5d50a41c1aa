#!/usr/bin/env python
"""Train with SpecForge 0.2.0's own command line, with the drafter's exact tau measured while it trains.

    python tools/specforge_train.py --states cached_states/qwen36-27b-v1 --every-n-train-steps 500 \
        [--keep-best-by-tau] [--eval-config eval.yaml] -- --config run.yaml [section.field=value ...]

Everything after -- is `specforge train`'s own arguments; several ranks: torchrun --nproc_per_node N
tools/specforge_train.py ... (docs/training-loops.md, "SpecForge").

Installed (``pip install -e .``), the same tool is the ``dflash-specforge-train`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.specforge_train"))
