"""The few collective operations the live evaluator needs, and sharded-parameter handling.

Collectives use ``torch.distributed`` directly (the default process group, when one is
initialised), so any training loop works: Lightning, the Hugging Face ``Trainer``, a plain loop.

Design (what makes distributed numbers equal single-process ones):

- Each rank scores ``samples[rank::world]``; per-sample results do not depend on which process
  computes them, and every metric is a ratio of integer counts, so the counts are summed with
  ONE ``all_reduce`` (which also carries an error flag, so that a failure on any rank is known on
  every rank and nobody waits in a collective that will never come) before any ratio is taken.
- Sharded parameters (FSDP): every rank must take part in gathering the full parameters. The
  evaluation gathers them once for the whole evaluation (FSDP1 ``summon_full_params``; FSDP2
  ``FSDPModule.unshard``), on every rank, and then each rank runs its own share of samples with
  no collective inside the drafter at all. So ranks do not have to make the same number of
  forward passes, and sample lists need no padding. The price is the drafter's full parameters in
  memory for the duration of the evaluation (a Qwen3.6-27B DFlash drafter: about 3 GB in bf16).
- DeepSpeed ZeRO-3 is not supported (refused at setup); ZeRO-1/2 keep full parameters and work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if not dist_ready():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def collective_device() -> torch.device:
    """NCCL needs CUDA tensors (on this rank's current device); gloo takes CPU ones."""
    if dist_ready() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(flat: torch.Tensor) -> torch.Tensor:
    """Sum a float64 vector over ranks (identity in a single process)."""
    if world()[1] == 1:
        return flat
    t = flat.to(device=collective_device(), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's (small, picklable) ``obj`` on every rank, in rank order."""
    ws = world()[1]
    if ws == 1:
        return [obj]
    out: list[Any] = [None] * ws
    dist.all_gather_object(out, obj)  # all_gather: supported by every backend, payload is small
    return out


def gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank zero (list in rank order); None on the other ranks."""
    out = all_gather(obj)
    return out if world()[0] == 0 else None


def _fsdp1_modules(root: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]


def _fsdp2_modules(root: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return []
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def module_sharding(root: nn.Module | None) -> str | None:
    """"fsdp1", "fsdp2" or None: how ``root``'s parameters are sharded (any training loop)."""
    if isinstance(root, nn.Module):
        if _fsdp1_modules(root):
            return "fsdp1"
        if _fsdp2_modules(root):
            return "fsdp2"
    return None


def sharding_kind(trainer: Any) -> str | None:
    """"fsdp1", "fsdp2", "deepspeed3" or None (parameters are whole on every rank), for a Lightning trainer."""
    strategy = getattr(trainer, "strategy", None)
    kind = module_sharding(getattr(strategy, "model", None))
    if kind is not None:
        return kind
    cfg = getattr(strategy, "config", None)
    if type(strategy).__name__.startswith("DeepSpeed") and isinstance(cfg, dict):
        if int(cfg.get("zero_optimization", {}).get("stage", 0)) >= 3:
            return "deepspeed3"
    return None


@contextlib.contextmanager
def full_parameters_of(root: nn.Module | None) -> Iterator[None]:
    """Make every parameter of ``root`` whole on every rank for the duration (a collective under FSDP:
    all ranks must enter). Outside FSDP this does nothing. Parameters are gathered without write-back:
    the evaluation only reads them, and the training copy (and its optimizer state) is left as it was.
    """
    kind = module_sharding(root)
    if kind is None:
        yield
        return
    assert root is not None
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(root, writeback=False, recurse=True):
            yield
        return
    mods = _fsdp2_modules(root)
    for m in mods:
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()


@contextlib.contextmanager
def full_parameters(trainer: Any) -> Iterator[None]:
    """``full_parameters_of`` the Lightning trainer's wrapped model; DeepSpeed ZeRO-3 is refused."""
    if sharding_kind(trainer) == "deepspeed3":
        raise RuntimeError("DeepSpeed ZeRO stage 3 shards parameters in a way this callback cannot gather; "
                           "use ZeRO stage 1/2, DDP or FSDP")
    with full_parameters_of(getattr(getattr(trainer, "strategy", None), "model", None)):
        yield


def end_process_group(group: Any = None, destroy: Any = None) -> None:
    """Tear a process group down once every rank got here: a rank that tears down while another still talks
    to it (or exits with it) can abort that rank at exit. ``destroy`` replaces ``dist.destroy_process_group``
    (SpecForge's own teardown)."""
    if dist_ready() and dist.get_world_size() > 1:
        with contextlib.suppress(RuntimeError):  # a peer already gone: nothing left to wait for
            dist.barrier()
    if destroy is not None:
        destroy()
    elif dist.is_initialized():
        dist.destroy_process_group(group)
