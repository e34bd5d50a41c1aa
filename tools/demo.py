#!/usr/bin/env python
"""End-to-end CPU demo: a tiny target, its cached states, a DFlash drafter trained with the callback.

    python tools/demo.py [--out demo_out] [--seed 0] [--steps 1200] [--eval-every 100] [--quick]
                         [--overwrite] [--wandb-mode offline|online]

About 3 minutes on 2 CPU cores. The logic lives in dflash_cb.demo.demo.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_cb.common.cli import run  # noqa: E402
from dflash_cb.demo.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(main))
