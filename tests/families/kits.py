"""What the conformance suite needs of each drafter family, registered here by name: a small config, the
family's own reference module with our module's weights, its own reference generate loop (an oracle not written by
us), and the variants replayed besides its config (``Variant``: other head types and settings, a block of 16, a
sliding window shorter than the contexts). A family the registry finds (``dflash_cb.core.drafters.registry``)
without a kit here fails the suite's first test: registering a family means adding its kit, not copying a test
file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import oracles
import torch

LAYERS = [1, 3]  # outputs of decoder layers 1 and 3 of the 4-layer tiny target


@dataclass(frozen=True)
class Variant:
    """Another setting of a family's drafter, replayed against a reference loop as well."""

    name: str
    fields: dict = field(default_factory=dict)  # the dflash_config fields it changes
    block: int | None = None  # the drafter's block size, when not the suite's
    sliding: bool | None = None  # a sliding-window layer, when not the kit's choice
    loop: Callable[..., list[int]] | None = None  # its reference loop, when not the kit's


@dataclass(frozen=True)
class Kit:
    config: Callable[..., dict]  # (vocab, hidden, block, sliding window: None = the kit's choice) -> config.json
    reference: Callable[[Any, dict], Any]  # (our trained module, its config) -> the reference module, same weights
    loop: Callable[..., list[int]]  # (reference, target, prompt [1, P], max_new, stops, block) -> lengths
    loss: Any = None  # tiny_target.train_briefly's extra loss term
    train_epochs: int = 6
    tail_blocks: str = "reference"  # the reference loop's tail: shortened blocks (dflash_generate) or full ones
    prepare: Callable[[Any], None] | None = None  # after training: weights the objective leaves at their init
    variants: tuple[Variant, ...] = ()  # other settings, each replayed too
    train: Callable[[Any, Any], Any] | None = None  # (module, cache) -> trained module, instead of train_briefly
    adoptable: bool = True  # the reference module itself is scored (adopted zero-copy)
    layers: tuple[int, ...] = tuple(LAYERS)  # the target layers the drafter reads

    def variant(self, name: str) -> Variant:
        """The named variant ("": the kit's own config)."""
        return next((v for v in self.variants if v.name == name), Variant(""))

    def config_of(self, name: str, vocab: int, hidden: int, block: int) -> dict:
        """``config`` of the named variant, ``block`` unless the variant sets its own."""
        v = self.variant(name)
        cfg = self.config(vocab, hidden, v.block or block, v.sliding)
        if v.fields:
            cfg["dflash_config"] = {**cfg["dflash_config"], **v.fields}
        return cfg

    def loop_of(self, name: str) -> Callable[..., list[int]]:
        return self.variant(name).loop or self.loop


def _block_config(architecture: str, sliding: bool = True, **fields: Any) -> Callable[..., dict]:
    def config(vocab: int, hidden: int, block: int, window: bool | None = None) -> dict:
        # The second layer causal with a window shorter than the contexts (docs/method.md), where the family's
        # reference loop runs the served masks.
        layers = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=9,
                      use_sliding_window=True) if (sliding if window is None else window) else {}
        return dict(
            architectures=[architecture], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=512, rms_norm_eps=1e-6, num_target_layers=4, block_size=block, **layers,
            dflash_config={"target_layer_ids": LAYERS, "mask_token_id": vocab - 1, **fields})

    return config


def _dflash_generate(ref: Any, target: Any, prompt: torch.Tensor, max_new: int, stops: list[int],
                     block: int) -> list[int]:
    """dflash's own ``dflash_generate`` (it times itself with CUDA events; a wall clock does that job here)."""
    dm = oracles.require("dflash.model")
    orig = dm._cuda_time
    dm._cuda_time = time.perf_counter
    try:
        run = dm.dflash_generate(ref, target, prompt, max_new, stops, block_size=block, return_stats=True)
    finally:
        dm._cuda_time = orig
    return list(run.acceptance_lengths)


def _dflash_reference(ours: Any, cfg: dict) -> Any:
    from transformers import Qwen3Config

    ref = oracles.require("dflash.model").DFlashDraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict(ours.state_dict())
    return ref


def _dflash2_reference(ours: Any, cfg: dict) -> Any:
    from transformers import Qwen3Config

    ref = oracles.require("dflash.model").DFlash2DraftModel(Qwen3Config(**cfg)).eval()
    # The reference module's codebooks are embeddings.
    ref.load_state_dict({k + ".weight" if k.endswith("codebook") else k: v for k, v in ours.state_dict().items()})
    return ref


def _selector_loss(*args: Any) -> Any:
    from tiny_target import selector_loss

    return selector_loss(*args)


def _dspark_reference(ours: Any, cfg: dict) -> Any:
    """SpecForge 0.2.0's own ``DSparkDraftModel`` (built from its config: its ``from_pretrained`` leaves the rotary
    cache unset under this transformers) with our module's weights."""
    from transformers import Qwen3Config

    ref = oracles.require("specforge.modeling.draft.dspark").DSparkDraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref


def _absolute_crop_cache() -> type:
    from transformers import DynamicCache

    class AbsoluteCrop(DynamicCache):
        """``crop(n)`` with ``n >= 0`` keeps the first n positions (SpecForge 0.2.0 calls it so); transformers 5.x
        takes only the number of positions to drop. The environment's adapter, not the oracle's logic."""

        def crop(self, max_length: int) -> None:
            drop = self.get_seq_length() - max_length if max_length >= 0 else -max_length
            if drop > 0:
                super().crop(-drop)

    return AbsoluteCrop


_AbsoluteCrop = _absolute_crop_cache()


def _spec_generate(ref: Any, target: Any, prompt: torch.Tensor, max_new: int, stops: list[int],
                   block: int) -> list[int]:
    """SpecForge's own ``spec_generate`` loop (greedy); each cycle's accepted length read off the blocks it
    drafted (its ``_sample_draft_tokens``) against the tokens it committed."""
    drafted: list[torch.Tensor] = []
    own = type(ref)._sample_draft_tokens

    def record(self: Any, target_model: Any, hidden: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        out = own(self, target_model, hidden, block_ids)
        drafted.append(out[0].clone())
        return out

    sf = oracles.require("specforge.modeling.draft.dflash")
    saved, cache_class = ref.block_size, sf.DynamicCache
    ref.block_size = block
    ref._sample_draft_tokens = record.__get__(ref)
    sf.DynamicCache = _AbsoluteCrop  # its loop crops to an absolute length, as transformers' caches did before 5.x
    try:
        out = ref.spec_generate(target, prompt, max_new, stops, 0.0)[0].tolist()
    finally:
        ref.block_size, sf.DynamicCache = saved, cache_class
        del ref._sample_draft_tokens
    # Its loop runs one more cycle than the completion needs (its last commits past max_new_tokens and is cut)
    # and counts each cycle whole: read at the loop's end as dflash_generate's, where the cache's completion ends
    # (max_new_tokens or the first stop token).
    p = prompt.shape[1]
    end = min([p + max_new] + [p + i + 1 for i, t in enumerate(out[p:]) if t in stops])
    lengths, start = [], p
    for d in drafted:
        if start + 1 >= end:
            break
        n = 0
        while n < len(d) and start + 1 + n < len(out) and int(d[n]) == out[start + 1 + n]:
            n += 1
        lengths.append(min(n + 1, end - 1 - start))
        start += n + 1
    return lengths


def _spec_generate_on_dflash_backbone(ref: Any, target: Any, prompt: torch.Tensor, max_new: int, stops: list[int],
                                      block: int) -> list[int]:
    """SpecForge's own ``spec_generate`` and heads (``_sample_draft_tokens``) over the DFlash authors' backbone:
    dflash 0.1.0's ``DFlashDraftModel`` with the reference's backbone weights, which runs a ``sliding_attention``
    layer causal within its window (as SpecForge trains it: ``create_dflash_sdpa_mask``). SpecForge 0.2.0's own
    forward passes no mask in its loop and leaves the window to the attention kernel, which sdpa and eager ignore:
    its loop alone is no oracle for a windowed drafter off flash-attention."""
    from transformers import Qwen3Config

    heads = ("markov_head.", "confidence_head.", "prefix_gru.", "embed_proj.")
    backbone = oracles.require("dflash.model").DFlashDraftModel(Qwen3Config(**ref.config.to_dict())).eval()
    backbone.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith(heads)}, strict=True)
    ref.forward = backbone.forward
    try:
        return _spec_generate(ref, target, prompt, max_new, stops, block)
    finally:
        del ref.forward


def _domino_reference(ours: Any, cfg: dict) -> Any:
    """SpecForge 0.2.0's own ``DominoDraftModel`` (built from its config) with our module's weights."""
    from transformers import Qwen3Config

    ref = oracles.require("specforge.modeling.draft.domino").DominoDraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref


def random_correction(ours: Any, scale: float = 0.4) -> None:
    """The block objective leaves the GRU and its projection at their init: weights that change drafts."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in (*ours.prefix_gru.parameters(), *ours.embed_proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _light_correction(ours: Any) -> None:
    """A correction that changes drafts and leaves cycles accepting several tokens (0.4 leaves tau near 1)."""
    random_correction(ours, 0.08)


def random_markov_head(ours: Any) -> None:
    """Markov head weights large enough that they change drafts (of a drafter not trained; the kit's drafters train
    theirs: DSpark's objective adds the head's term, ``DSparkFamily.extra_loss``)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ours.markov_head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _mtp_config(vocab: int, hidden: int, block: int, window: bool | None = None) -> dict:
    """The MTP head of the tiny target (4 layers: layer 3's output is its final-normed state, what the MTP reads)."""
    return dict(architectures=["Qwen3_5MTPDrafter"], drafter_family="mtp", model_type="qwen3_5_text",
                vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512,
                num_hidden_layers=1, mtp_num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                target_layer_ids=[3], num_target_layers=4, num_speculative_tokens=block - 1)


def _mtp_reference(ours: Any, cfg: dict) -> Any:
    from chain_reference import ReferenceMtp
    from transformers import Qwen3_5TextConfig

    return ReferenceMtp(Qwen3_5TextConfig(**cfg), ours.state_dict()).eval()


def _mtp_generate(ref: Any, target: Any, prompt: torch.Tensor, max_new: int, stops: list[int], block: int) -> list[int]:
    from chain_reference import mtp_generate

    return mtp_generate(ref, target, prompt[0].tolist(), max_new, stops, block - 1)


# EAGLE-3 reads layer outputs other than the last (whose cached state is the final-normed one a DFlash drafter
# reads, not the residual stream SGLang captures for EAGLE-3): of the suite's layers, layer 1, three times.
EAGLE_LAYERS = (1, 1, 1)


def _eagle3_config(vocab: int, hidden: int, block: int, window: bool | None = None) -> dict:
    from eagle3_reference import eagle_config

    return eagle_config(list(EAGLE_LAYERS), vocab_size=vocab, target_hidden_size=hidden, num_target_layers=4,
                        num_speculative_tokens=block - 1)


def _eagle3_reference(ours: Any, cfg: dict) -> Any:
    from eagle3_reference import specforge_module

    return specforge_module(cfg, ours.state_dict())


def _eagle3_generate(ref: Any, target: Any, prompt: torch.Tensor, max_new: int, stops: list[int],
                     block: int) -> list[int]:
    from eagle3_reference import specforge_generate

    return specforge_generate(ref, target, prompt[0].tolist(), stops, block - 1, "served", max_new)


def _train_eagle3(ours: Any, cache: Any) -> Any:
    from eagle3_reference import train_eagle3, with_draft_vocabulary

    return train_eagle3(with_draft_vocabulary(ours, cache), cache)


def _train_chain(ours: Any, cache: Any) -> Any:
    from chain_reference import train_chain

    return train_chain(ours, cache)


KITS: dict[str, Kit] = {
    "dflash": Kit(_block_config("DFlashDraftModel"), _dflash_reference, _dflash_generate),
    "dflash2": Kit(_block_config("DFlash2DraftModel", conv_group_size=8, conv_kernel_size=2, selector_rank=8,
                                 selector_top_k=4),
                   _dflash2_reference, _dflash_generate, loss=_selector_loss, train_epochs=20),
    "dspark": Kit(_block_config("DSparkDraftModel", sliding=False, projector_type="dspark", markov_rank=8,
                                markov_head_type="gated", confidence_head_alpha=0.5),
                  _dspark_reference, _spec_generate, tail_blocks="served",
                  variants=(Variant("rnn", {"markov_head_type": "rnn"}), Variant("vanilla", {"markov_head_type": "vanilla"}),
                            Variant("block16", block=16),
                            Variant("window", sliding=True, loop=_spec_generate_on_dflash_backbone))),
    "domino": Kit(_block_config("DominoDraftModel", sliding=False, projector_type="domino", emb_dim=16,
                                gru_hidden_dim=8),
                  _domino_reference, _spec_generate, tail_blocks="served", prepare=_light_correction,
                  variants=(Variant("shift_label", {"shift_label": True}), Variant("block16", block=16),
                            Variant("window", sliding=True, loop=_spec_generate_on_dflash_backbone))),
    "mtp": Kit(_mtp_config, _mtp_reference, _mtp_generate, tail_blocks="served", train=_train_chain, adoptable=False,
               layers=(3,)),
    "eagle3": Kit(_eagle3_config, _eagle3_reference, _eagle3_generate, tail_blocks="served", train=_train_eagle3,
                  layers=EAGLE_LAYERS),
}

# (family, variant) pairs the suite replays: every family's kit, then its variants.
CASES = [(f, v) for f in sorted(KITS) for v in ("", *(v.name for v in KITS[f].variants))]
