#!/usr/bin/env python
"""Create (or update) the dflash-cb W&B workspace view, or with --report a W&B Report.

    python tools/wandb_panels.py --entity E --project P [--run RUN_ID | --run wandb/offline-run-... |
                                                         --budgets 16,32,64 --categories a,b ...]

Sections: Headline, Uncertainty, Per category, Per depth, By position, Cost, Samples. Needs
``pip install wandb-workspaces`` (the ``panels`` extra) and a W&B login for the final save.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_cb.common.cli import run  # noqa: E402
from dflash_cb.integrations.panels import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(main))
