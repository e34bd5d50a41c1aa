#!/usr/bin/env python
"""Score a saved DFlash drafter on a cache of target states: exact tau, DDTree, per-depth acceptance.

    python tools/eval_drafter.py --states cached_states/qwen36-27b-v1 --drafter path/to/drafter \
        --out results.json [--ddtree-budgets 16,32,64] [--device cuda] [--dtype bfloat16]
        [--samples N | --sample-ids a,b,c] [--no-verify]

Every argument, the cache, the drafter and the head are checked (and the shards to score hashed)
before the evaluation starts; a problem is one line naming the file and the fix, exit code 2.

Installed (``pip install -e .``), the same tool is the ``dflash-eval`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.eval_drafter"))
