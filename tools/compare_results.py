#!/usr/bin/env python
"""Compare drafters scored on one cache: tau with 95% intervals, paired differences and a verdict.

    python tools/compare_results.py zlab.json ours.json [more.json ...] [--labels zlab,ours] [--out comparison]

Writes comparison.md (to paste in a PR) and comparison.png; refuses files from different caches.

Installed (``pip install -e .``), the same tool is the ``dflash-compare`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.compare"))
