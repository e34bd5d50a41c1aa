"""The demo's surroundings, set before any work: quiet libraries, torch's threads and seed, W&B's credentials."""

from __future__ import annotations

from ..common.threads import oversubscribed, set_threads
from .config import DemoConfig, DemoError


def quiet() -> None:
    """Keep the demo's own output readable: no per-file progress bars or tips from the libraries."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (imported first: its import resets its loggers to INFO)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")


def setup_torch(cfg: DemoConfig) -> None:
    import torch

    set_threads(max(1, cfg.threads))
    busy = oversubscribed(max(1, cfg.threads))
    if busy:
        print(f"note: {busy}", flush=True)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)


def check_wandb(mode: str) -> None:
    """Online mode needs credentials; find out now, not after the target has been trained."""
    if mode != "online":
        return
    import wandb

    if not wandb.login(prompt=False, verify=False):
        raise DemoError("--wandb-mode online: W&B has no credentials here; run `wandb login` (or set "
                        "WANDB_API_KEY), or leave the default --wandb-mode offline and `wandb sync` the run later")
