#!/usr/bin/env python
"""Strip a training checkpoint down to a drafter folder (config.json + model.safetensors).

    python tools/extract_drafter.py --ckpt lightning_logs/.../step=1000.ckpt --out drafters/step1000 \
        [--config drafter_config.json] [--prefix drafter.]

See ``--help``; the code is ``dflash_cb.core.extract_cli`` and ``dflash_cb.core.checkpoints.extract_drafter``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_cb.common.cli import run  # noqa: E402
from dflash_cb.core.extract_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(main))
