"""What every ``tools/*.py`` script does: run its tool's console command (``[project.scripts]``).

The scripts import the installed package (``pip install -e .``, which ``python dev.py`` runs); a
checkout that is not installed fails with one line saying so, exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

NOT_INSTALLED = ("error: the dflash_cb package is not installed for {python}; run `pip install -e .` in "
                 "{root} (or `python dev.py setup`), then run the tool again")


def run_command(module: str, name: str = "command") -> int:
    """``module.name``: the command behind a tool, the same object its console script runs, imported under
    the start-up Ctrl-C handler (``dflash_cb.common.cli.launch``)."""
    try:
        from dflash_cb.common.cli import launch
    except ModuleNotFoundError as e:
        if e.name != "dflash_cb":
            raise
        print(NOT_INSTALLED.format(python=sys.executable, root=Path(__file__).resolve().parents[1]), file=sys.stderr)
        return 2
    return launch(module, name)
