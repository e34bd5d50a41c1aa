#!/usr/bin/env python
"""Train a DFlash drafter with LightningCLI, evaluated live by DFlashEvalCallback.

    python examples/lightning_cli.py fit --config configs/train/lightning_cli.yaml

Runs as it is after ``python tools/demo.py`` (the demo's caches and drafter shape, CPU); point the paths of the
config at your caches, or add ``--config configs/callback/dflash_eval.yaml`` for every argument of the callback.
The module and the data are the demo's (``dflash_cb.demo.lightning_module``): replace them with yours, the
callback needs only an attribute of the module that holds the drafter (``drafter:``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule


def main(args: Sequence[str] | None = None) -> LightningCLI:
    """The command line (``args``: its arguments, None = ``sys.argv``); the config it ran is saved beside the logs."""
    return LightningCLI(DFlashDrafterModule, CachedStatesDataModule, args=args,
                        save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
