#!/usr/bin/env python
"""Check a projected speedup against real greedy speculative decoding on this machine: the speed check.

    python tools/speed_check.py --target TARGET_DIR --drafter DRAFTER_DIR --states CACHE --out check.json \
        [--ddtree-budgets 32] [--profile profile.json [--profile-out profile.checked.json]] [--device cuda]

Installed, the same tool is ``dflash-speed-check``.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.speed_check"))
