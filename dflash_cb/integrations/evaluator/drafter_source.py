"""Where the drafter and the target's weights are inside a training model.

Every adapter names them the same way: an attribute path (``"drafter"``, ``"model.draft"``), a function
``model -> module``, or None for the model itself; wrappers that only hold the real module
(``torch.compile``'s ``_orig_mod``, ``nn.DataParallel``/DDP's ``module``) are looked through.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from ...common.errors import DFlashCBError

DrafterSource = str | Callable[[Any], nn.Module] | None


class DrafterNotFoundError(DFlashCBError, AttributeError):
    """The drafter (or a target weight) is not where the adapter was told to look."""


class NotADrafterError(DFlashCBError, TypeError):
    """The module found is no drafter (no ``.spec``, no drafter ``.config``)."""


def unwrap(module: nn.Module) -> nn.Module:
    """The module under wrappers that only hold it: ``torch.compile`` (``_orig_mod``), ``nn.DataParallel`` and
    ``DistributedDataParallel`` (``module``), nested in any order."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None and isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = module.module
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def find_drafter(model: Any, source: DrafterSource, owner: str, required: bool = True) -> nn.Module | None:
    """The drafter inside the training ``model`` (see the module's docstring). ``owner`` names the caller
    in errors; with ``required=False`` a drafter that does not exist yet (built in ``configure_model``)
    gives None."""
    if source is None or source == "":
        module = model
    elif isinstance(source, str):
        try:
            module = attrgetter(source)(unwrap(model) if isinstance(model, nn.Module) else model)
        except AttributeError:
            if not required:
                return None
            inner = unwrap(model) if isinstance(model, nn.Module) else model
            children = ", ".join(n for n, _ in inner.named_children()) if isinstance(inner, nn.Module) else ""
            raise DrafterNotFoundError(
                f"{owner}: the {type(inner).__name__} has no attribute {source!r} (its submodules: "
                f"{children or 'none'}); set drafter= to the drafter's attribute path or to a function "
                "model -> drafter") from None
    else:
        module = source(model)
    if module is None:
        if required:
            raise DrafterNotFoundError(f"{owner}: drafter {source!r} resolved to None")
        return None
    if not isinstance(module, nn.Module):
        raise DrafterNotFoundError(f"{owner}: drafter {source!r} is a {type(module).__name__}, not a torch module")
    return unwrap(module)


def target_weight(model: Any, source: Any, owner: str) -> torch.Tensor:
    """A target matrix (``EvalConfig.target_embed``/``target_lm_head``): from an attribute path on ``model``,
    an ``nn.Embedding``/``nn.Linear``, or the tensor itself."""
    if isinstance(source, str):
        if model is None:
            raise DrafterNotFoundError(f"{owner}: {source!r} is an attribute path; pass the model that holds it "
                                       "(model=...) or the tensor itself")
        try:
            source = attrgetter(source)(unwrap(model) if isinstance(model, nn.Module) else model)
        except AttributeError:
            raise DrafterNotFoundError(f"{owner}: the model ({type(model).__name__}) has no attribute "
                                       f"{source!r}") from None
    if isinstance(source, (nn.Embedding, nn.Linear)):
        return source.weight
    if isinstance(source, torch.Tensor):
        return source
    raise DrafterNotFoundError(f"{owner}: the target weight is a {type(source).__name__}; expected nn.Embedding, "
                               "nn.Linear or a [vocab, hidden] tensor")


def describe_source(source: Any) -> str:
    return source if isinstance(source, str) else type(source).__name__
