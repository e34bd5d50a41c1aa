"""Non-finite numbers get no tau: a drafter with a NaN or infinite weight (a diverged run) would still get a
plausible-looking tau, since the argmax of NaN logits is some token. One pass over the tensors, counted on the
device and read back once; the message names the tensors and how many entries."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...common.errors import DFlashCBError

SHOWN = 4  # tensors named in a message


class NonFiniteError(DFlashCBError, ValueError):
    """Weights or logits with NaN or infinite entries: no figure is computed from them."""


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, int, int]]:
    """(name, non-finite entries, entries) of every floating tensor with a NaN or an infinity, in order."""
    floats = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not floats:
        return []
    bad = torch.stack([(~torch.isfinite(t.detach())).sum().to("cpu") for _, t in floats]).tolist()
    return [(n, int(b), t.numel()) for (n, t), b in zip(floats, bad, strict=True) if b]


def check_finite_weights(named: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Raise ``NonFiniteError`` naming the tensors of ``source`` that hold NaN or infinite entries."""
    bad = nonfinite_tensors(named)
    if not bad:
        return
    shown = ", ".join(f"{n} ({b} of {t} entries)" for n, b, t in bad[:SHOWN])
    more = f" and {len(bad) - SHOWN} more tensor(s)" if len(bad) > SHOWN else ""
    raise NonFiniteError(f"{source}: weights with NaN or infinite entries: {shown}{more}; no tau is computed from "
                         "them (the training diverged? evaluate an earlier checkpoint)")


def check_finite_logits(logits: torch.Tensor, dtype: torch.dtype) -> None:
    """Finite weights gave NaN or infinite logits: an overflow in the compute precision."""
    if not bool(torch.isfinite(logits).all()):
        n = int((~torch.isfinite(logits)).sum())
        raise NonFiniteError(f"the drafter's logits have {n} NaN or infinite entries although its weights are "
                             f"finite: an overflow in {dtype} compute; evaluate in float32 (--dtype float32, "
                             "autocast_dtype=None)")
