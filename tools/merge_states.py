#!/usr/bin/env python
"""Merge the parts of a `precompute_states.py --num-shards N --shard-index I` run into one cache.

Usage: python tools/merge_states.py --out cached_states/qwen36-27b-v1 part0/ part1/ ...
The merged cache equals what a single-host run would have written (same manifest, same shards).
"""

import sys

from dflash_cb.cache.precompute import merge_main

if __name__ == "__main__":
    sys.exit(merge_main())
