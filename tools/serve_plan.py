#!/usr/bin/env python
"""Which drafter to serve, at which setting: projected speedups of several drafters scored on one cache.

    python tools/serve_plan.py dflash.json dflash2.json --labels dflash,dflash2 --out plan

Each results file comes from ``tools/eval_drafter.py --profile PROFILE`` (one profile for all). Writes plan.md and
plan.png. Installed, the same tool is ``dflash-serve-plan``.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.serve_plan"))
