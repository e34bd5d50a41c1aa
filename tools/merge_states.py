#!/usr/bin/env python
"""Merge the parts of a `precompute_states.py --num-shards N --shard-index I` run into one cache.

Usage: python tools/merge_states.py --out cached_states/qwen36-27b-v1 part0/ part1/ ...
The merged cache equals what a single-host run would have written (same manifest, same shards).

Installed (``pip install -e .``), the same tool is the ``dflash-merge`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.cache.precompute.cli", "merge_command"))
