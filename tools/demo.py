#!/usr/bin/env python
"""End-to-end CPU demo: a tiny target, its cached states, a DFlash drafter trained with the callback.

    python tools/demo.py [--out demo_out] [--seed 0] [--steps 1200] [--eval-every 100] [--quick]
                         [--overwrite] [--wandb-mode offline|online]

About 3 minutes on 2 CPU cores. The logic lives in dflash_cb.demo.demo.

Installed (``pip install -e .``), the same tool is the ``dflash-demo`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.demo.demo"))
