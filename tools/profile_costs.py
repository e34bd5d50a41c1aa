#!/usr/bin/env python
"""Measure (or state) the step costs the serving projection prices a replay with: a cost profile.

    python tools/profile_costs.py --target TARGET_DIR --drafter DRAFTER_DIR --out profile.json [--device cuda]
    python tools/profile_costs.py --roofline --bandwidth-gbs 4800 --peak-tflops 989 --target TARGET_DIR --out p.json
    python tools/profile_costs.py --from-csv verify.csv --draft-seconds 0.004 --states CACHE --out profile.json

Then ``tools/eval_drafter.py ... --profile profile.json``. Installed, the same tool is ``dflash-profile``.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.profile_costs"))
