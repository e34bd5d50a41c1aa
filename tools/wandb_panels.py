#!/usr/bin/env python
"""Create (or update) the dflash-cb W&B workspace view, or with --report a W&B Report.

    python tools/wandb_panels.py --entity E --project P [--run RUN_ID | --run wandb/offline-run-... |
                                                         --budgets 16,32,64 --categories a,b ...]

Sections: Headline, Uncertainty, Per category, Per depth, By position, Cost, Samples. Needs
``pip install wandb-workspaces`` (the ``panels`` extra) and a W&B login for the final save.

Installed (``pip install -e .``), the same tool is the ``dflash-panels`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.tracking.panels"))
