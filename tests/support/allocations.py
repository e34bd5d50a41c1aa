"""Counting the tensors an operation allocates, by size, without a GPU or wall time.

A ``TorchDispatchMode`` sees every aten operation (autocast's casts included) after autograd and
autocast have done their part, so the outputs it records are the tensors torch really allocates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Allocations(TorchDispatchMode):
    """Records (op name, shape, dtype, bytes) of every non-view output that ``keep`` accepts."""

    def __init__(self, keep: Callable[[torch.Tensor], bool] = lambda t: True):
        super().__init__()
        self.keep = keep
        self.seen: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and self.keep(t):
                    self.seen.append((str(func), tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out

    @property
    def largest(self) -> int:
        return max((b for *_, b in self.seen), default=0)
