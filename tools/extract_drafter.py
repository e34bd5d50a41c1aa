#!/usr/bin/env python
"""Strip a training checkpoint down to a drafter folder (config.json + model.safetensors).

    python tools/extract_drafter.py --ckpt lightning_logs/.../step=1000.ckpt --out drafters/step1000 \
        [--config drafter_config.json] [--prefix drafter.]

See ``--help``; the code is ``dflash_cb.integrations.cli.extract`` and ``dflash_cb.core.checkpoints.load.extract_drafter``.

Installed (``pip install -e .``), the same tool is the ``dflash-extract`` command.
"""

import sys

from _command import run_command

if __name__ == "__main__":
    sys.exit(run_command("dflash_cb.integrations.cli.extract"))
