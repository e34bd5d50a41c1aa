"""A small, reusable Lightning setup that trains a DFlash drafter on cached target states.

``DFlashDrafterModule`` trains ``self.drafter`` (a ``DFlashDrafter`` or ``DFlash2Drafter``) with the DFlash objective
(``training.dflash_loss``: random anchors, a block of mask tokens after each, cross-entropy
against the target's tokens) on the context features stored in a cache; a chain drafter (EAGLE-3, an MTP head)
with its first step's teacher-forced cross-entropy (``chain_first_step_loss``: row t drafts the token at t + 2). The target's embedding
and output head are frozen, non-persistent buffers (``target_embed``, ``target_lm_head``), so
checkpoints hold only the drafter (``tools/extract_drafter.py`` finds it under ``drafter.``) and
the drafter config is in ``hyper_parameters.drafter_config``.

``CachedStatesDataModule`` serves cached samples (one sample = prompt + completion features).
The demo (``tools/demo.py``) and the callback tests use both; a real team keeps its own module
and only adds ``DFlashEvalCallback``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, Dataset

from ..cache.states import StateCache, TargetHead
from ..core.drafters.layouts import drafter_from_config
from ..core.drafters.registry import family_named, family_of
from ..core.drafters.spec import DEFAULT_FAMILY
from ..core.drafters.training import batch_loss


class CachedStatesDataset(Dataset):
    """Cached samples as dicts of tensors (memory-mapped reads, one sample at a time). ``layer_ids``: the
    drafter's target layers, when the cache holds more (``StateCache.feature_columns``); None = all of them."""

    def __init__(self, states: str | os.PathLike, sample_ids: Sequence[str] | None = None, min_completion: int = 2,
                 layer_ids: Sequence[int] | None = None):
        self.states = str(states)
        cache = StateCache(states)
        self.columns = None if layer_ids is None else cache.feature_columns(layer_ids)
        ids = list(sample_ids) if sample_ids is not None else [s.id for s in cache.samples]
        # A sample needs at least one anchor with a known next token to train on.
        self.ids = [i for i in ids if cache.entry(i).valid_len - cache.entry(i).prompt_len >= min_completion]
        self._cache: StateCache | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._cache is None:  # opened lazily: a DataLoader worker opens its own
            self._cache = StateCache(self.states)
        s = self._cache.load(self.ids[i])
        hidden = s.hidden if self.columns is None else s.hidden.index_select(1, self.columns)
        return {"id": s.entry.id, "input_ids": s.input_ids, "hidden": hidden,
                "prompt_len": s.entry.prompt_len, "valid_len": s.entry.valid_len}


def collate_samples(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples differ in length: a batch is a list of samples."""
    return batch


class CachedStatesDataModule(LightningDataModule):
    """Training batches of cached samples.

    Args:
        states: cache folder.
        batch_size: samples per training step.
        sample_ids: train on these samples only (default: all).
        shuffle: shuffle the samples every epoch (from the global, seeded RNG).
        num_workers: DataLoader workers.
        layer_ids: the drafter's target layers, when the cache holds more (None: all of the cache's).
    """

    def __init__(self, states: str, batch_size: int = 2, sample_ids: list[str] | None = None, shuffle: bool = True,
                 num_workers: int = 0, layer_ids: list[int] | None = None) -> None:
        super().__init__()
        self.states = states
        self.layer_ids = layer_ids
        self.batch_size = batch_size
        self.sample_ids = sample_ids
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.dataset: CachedStatesDataset | None = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            self.dataset = CachedStatesDataset(self.states, self.sample_ids, layer_ids=self.layer_ids)

    def train_dataloader(self) -> DataLoader:
        assert self.dataset is not None
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle,
                          num_workers=self.num_workers, collate_fn=collate_samples)


class DFlashDrafterModule(LightningModule):
    """Train a DFlash drafter on cached target states.

    Args:
        drafter_config: the drafter's config (a Qwen3 config dict with ``num_target_layers``,
            ``block_size`` and ``dflash_config``: ``target_layer_ids``, ``mask_token_id``).
        states: cache folder whose exported target head (embedding + output head) the drafter uses.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        anchors_per_sample: random anchors (training blocks) drawn per sample per step.
        loss_decay: down-weight deep block positions by ``exp(-loss_decay * (k - 1))`` (0 = uniform).
        warmup_steps: linear learning-rate warm-up.
        init_seed: seed of the drafter's initial weights (a private generator; None = global RNG).
    """

    def __init__(self, drafter_config: dict[str, Any], states: str, lr: float = 3e-3, weight_decay: float = 0.0,
                 anchors_per_sample: int = 16, loss_decay: float = 0.0, warmup_steps: int = 0,
                 init_seed: int | None = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        # The class the config's family says (registry.family_of); its loss adds the family's own term.
        if init_seed is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed)
                self.drafter = drafter_from_config(drafter_config)
        else:
            self.drafter = drafter_from_config(drafter_config)
        self.chain = family_of(drafter_config).kind == "chain"  # trained on its first step (chain_first_step_loss)
        head = StateCache(states).load_head(dtype=torch.float32)
        # Frozen target matrices: buffers (move with the module, never trained), not saved in checkpoints.
        self.register_buffer("target_embed", head.embed_tokens.clone(), persistent=False)
        self.register_buffer("target_lm_head", head.lm_head.clone() if not head.tied else head.embed_tokens.clone(),
                             persistent=False)

    @property
    def head(self) -> TargetHead:
        return TargetHead(self.target_embed, self.target_lm_head, tied=False)

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> torch.Tensor:
        if self.chain:
            loss, acc1 = chain_first_step_loss(self.drafter, self.head, batch)
            self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
            self.log("train/acc_depth1", acc1, batch_size=len(batch))
            return loss
        loss, acc1 = batch_loss(self.drafter, self.head, batch, self.hparams.anchors_per_sample, self.hparams.loss_decay)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        self.log("train/acc_depth1", acc1, batch_size=len(batch))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.drafter.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        if not self.hparams.warmup_steps:
            return opt
        warm = max(1, int(self.hparams.warmup_steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def chain_first_step_loss(drafter: Any, head: TargetHead, batch: Sequence[dict[str, Any]]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, first-step accuracy) of a chain drafter over a batch of cached samples: each sample's rows up to
    its valid length run through the replay's own context pass (``chain.ChainRunner``), row t drafting the token at
    t + 2 (the token at t + 1 is the target's, fed in). The logits are the drafter's own head's over its draft
    vocabulary (EAGLE-3: tokens outside it are not supervised), else the target's output head (an MTP head)."""
    from ..core.drafters.chain import ChainRunner

    runner = ChainRunner(drafter, drafter.spec)
    own = getattr(drafter, "lm_head", None)
    index = None
    if own is not None:  # draft id -> target id is id + d2t: the target's ids as draft ids, -100 outside
        d2t = drafter.d2t
        index = torch.full((int(drafter.spec.vocab_size),), -100, dtype=torch.long, device=d2t.device)
        index[torch.arange(d2t.numel(), device=d2t.device) + d2t] = torch.arange(d2t.numel(), device=d2t.device)
    losses, hits, total = [], 0, 0
    for s in batch:
        n = int(s["valid_len"])
        ids = s["input_ids"][:n].long().to(head.embed_tokens.device)
        r = n - 2
        if r < 1:
            continue
        feats = s["hidden"][:r].to(head.embed_tokens.device, torch.float32)
        ctx = runner.context(iter([(feats, runner.token_embeddings(ids[1:r + 1], head.embed_tokens))]), [r])
        target = ids[2:r + 2]
        if own is not None:
            logits, target = own(ctx.head_in), index[target]
        else:
            logits = ctx.head_in @ head.lm_head.T.to(ctx.head_in.dtype)
        losses.append(torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100))
        kept = target != -100
        hits += int((logits.argmax(-1)[kept] == target[kept]).sum())
        total += int(kept.sum())
    if not losses:
        raise ValueError("no sample of the batch has two tokens to train a chain drafter's first step on")
    return torch.stack(losses).mean(), torch.tensor(hits / max(total, 1))


def tiny_drafter_config(vocab_size: int, target_hidden: int, target_layers: int, layer_ids: Sequence[int],
                        mask_token_id: int, block_size: int = 8, num_layers: int = 1, heads: int = 4,
                        kv_heads: int = 2, head_dim: int = 8, intermediate_size: int | None = None,
                        family: str = DEFAULT_FAMILY, **family_fields: Any) -> dict[str, Any]:
    """A small drafter config for a small target (tests, demo) of a registered block ``family``, with the small
    settings of its own fields (``DrafterFamily.tiny_fields``; DFlash 2: two-tap convolutions over groups of 8
    channels, a selector of 8 candidates and rank 16), overridden by ``family_fields``.

    The hidden size is the target's: block embeddings and logits use the target's own matrices.
    """
    fam = family_named(family)
    if fam.kind != "block":
        raise ValueError(f"family={family!r}: a tiny config is built for block families only")
    hidden = target_hidden
    config = {
        "architectures": [fam.architecture], "model_type": "qwen3",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": intermediate_size or 2 * hidden,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "num_target_layers": target_layers, "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id},
    }
    unknown = set(family_fields) - set(fam.config_fields)
    if unknown:
        raise ValueError(f"{sorted(unknown)}: not fields of a {fam.label} config ({', '.join(fam.config_fields) or 'none'})")
    config["dflash_config"].update({**fam.tiny_fields(hidden), **family_fields})
    return config
