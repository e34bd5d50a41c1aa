"""A dflash-cb cache as SpecForge 0.2.0's DFlash training data: in memory or as its offline feature files.

SpecForge's DFlash strategy trains on ``input_ids``, ``hidden_states`` (the target's layer features,
concatenated in ``target_layer_ids`` order: the cache's ``hidden``) and ``loss_mask``. The mask supervises the
completion on the target's own greedy path, ``prompt_len .. valid_len``: the positions the evaluation scores
(``tests/core/test_specforge_oracle.py`` checks SpecForge's accuracy on these batches against ours).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...cache.states import StateCache
from ...common.fileio import atomic_path


def sample_features(cache: StateCache, sample_id: str, layer_ids: Sequence[int] | None = None,
                    last_layer: int | None = None) -> dict[str, torch.Tensor]:
    """One sample's SpecForge features, unbatched: ``input_ids`` and ``loss_mask`` ``[seq]``, ``hidden_states``
    ``[seq, layers * hidden]`` (float32). ``layer_ids``: the drafter's target layers, when the cache holds more
    (None: all of the cache's). ``last_layer``: also ``target_last_hidden_states``, that cache layer's features,
    from the same read."""
    e = cache.entry(sample_id)
    s = cache.load(sample_id)
    loss_mask = torch.zeros(e.total_len, dtype=torch.long)
    loss_mask[e.prompt_len:e.valid_len] = 1
    columns = None if layer_ids is None else cache.feature_columns(layer_ids)
    hidden = s.hidden if columns is None else s.hidden.index_select(1, columns)
    out = {"input_ids": s.input_ids.long(), "loss_mask": loss_mask, "hidden_states": hidden.float()}
    if last_layer is not None:
        last = cache.feature_columns([last_layer])
        out["target_last_hidden_states"] = (s.hidden if last is None else s.hidden.index_select(1, last)).float()
    return out


def train_batches(states: str | os.PathLike | StateCache, sample_ids: Sequence[str] | None = None,
                  layer_ids: Sequence[int] | None = None, strategy: Any = None) -> list[Any]:
    """One SpecForge ``TrainBatch`` per sample, for ``TrainerController.fit`` or its ``eval_data_factory``
    (``layer_ids``: ``sample_features``). ``strategy``: SpecForge's strategy (class or object; None: its DFlash
    one), whose ``name`` the batches carry and whose ``required_features`` they hold: ``target_last_hidden_states``
    (its DSpark strategy's) is the target's state after its final norm, the cache's last target layer, which the
    cache must then hold (precompute it with that layer)."""
    from specforge.runtime.contracts import TrainBatch

    cache = states if isinstance(states, StateCache) else StateCache(states)
    name = getattr(strategy, "name", "dflash")
    last = None
    if "target_last_hidden_states" in getattr(strategy, "required_features", ()):
        last = int(cache.manifest.target["num_layers"]) - 1
        if last not in cache.manifest.layer_ids:
            raise ValueError(f"{cache.path}: SpecForge's {name} strategy reads the target's final-normed state, the "
                             f"cache's layer {last}, which it does not hold (it holds {cache.manifest.layer_ids}); "
                             f"precompute it with that layer too (--layers ...,{last})")
    out = []
    for i in sample_ids if sample_ids is not None else [e.id for e in cache.samples]:
        f = sample_features(cache, i, layer_ids, last)
        tensors = {"input_ids": f["input_ids"][None], "hidden_states": f["hidden_states"][None],
                   "loss_mask": f["loss_mask"][None].float()}
        if last is not None:
            tensors["target_last_hidden_states"] = f["target_last_hidden_states"][None]
        out.append(TrainBatch([i], name, tensors))
    return out


def write_offline_features(states: str | os.PathLike, folder: str | os.PathLike) -> list[Path]:
    """The cache as SpecForge's offline feature files (one ``.ckpt`` per sample, in cache order), for its
    command line's ``data.hidden_states_path`` / ``data.eval_hidden_states_path``."""
    cache = StateCache(states)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for n, e in enumerate(cache.samples):
        path = folder / f"{n:08d}.ckpt"
        with atomic_path(path) as tmp:
            torch.save(sample_features(cache, e.id), tmp)
        written.append(path)
    return written
