"""The block backbone's runners, where they were before the block kind's shared parts moved to ``block/``:
importable from here too."""

from ..block.runner import FastRunner, PerAnchorRunner

__all__ = ["FastRunner", "PerAnchorRunner"]
