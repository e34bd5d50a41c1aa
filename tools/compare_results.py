#!/usr/bin/env python
"""Compare drafters scored on one cache: tau with 95% intervals, paired differences and a verdict.

    python tools/compare_results.py zlab.json ours.json [more.json ...] [--labels zlab,ours] [--out comparison]

Writes comparison.md (to paste in a PR) and comparison.png; refuses files from different caches.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_cb.common.cli import run  # noqa: E402
from dflash_cb.core.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(main))
