#!/usr/bin/env python
"""Precompute a cache of target hidden states for offline DFlash evaluation.

Usage: python tools/precompute_states.py --config configs/precompute/qwen36-27b.yaml [--option value ...]
See `--help` and cached_states/README.md. The logic lives in dflash_cb.cache.precompute.
"""

import sys

from dflash_cb.cache.precompute import main

if __name__ == "__main__":
    sys.exit(main())
