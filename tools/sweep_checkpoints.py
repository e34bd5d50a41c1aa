#!/usr/bin/env python
"""Score every checkpoint of a training run on a cache: tau over the steps, the best checkpoint, W&B panels.

    python tools/sweep_checkpoints.py runs/exp1/checkpoints --states cached_states/qwen36-27b-v1 \
        --out sweeps/exp1 [--config drafter_config.json] [eval_drafter's options] [--watch]
        [--wandb-project P | --wandb-run-id ID]

Installed (``pip install -e .``), the same tool is the ``dflash-sweep`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.sweep_cli"))
