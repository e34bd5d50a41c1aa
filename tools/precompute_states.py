#!/usr/bin/env python
"""Precompute a cache of target hidden states for offline DFlash evaluation.

Usage: python tools/precompute_states.py --config configs/precompute/qwen36-27b.yaml [--option value ...]
See `--help` and cached_states/README.md. The logic lives in dflash_cb.cache.precompute.

Installed (``pip install -e .``), the same tool is the ``dflash-precompute`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.cache.precompute.cli"))
