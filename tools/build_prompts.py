#!/usr/bin/env python
"""Write the DFlash authors' benchmark prompt sets (their datasets, templates and subsample) as a prompt file.

Usage: python tools/build_prompts.py --preset dflash-paper --tokenizer <target folder> --out prompts.jsonl
(docs/precompute.md, "Build the authors' prompt sets"). Needs the ``prompts`` extra (``datasets``).

Installed (``pip install -e .``), the same tool is the ``dflash-build-prompts`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.cache.build_prompts"))
