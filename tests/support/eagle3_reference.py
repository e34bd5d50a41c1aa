"""SpecForge 0.2.0's own EAGLE-3 drafter as a test oracle: its ``LlamaForCausalLMEagle3`` built from a config with
our weights, driven in a per-cycle greedy loop (``specforge_generate``), and the small helpers that make and train
a tiny EAGLE-3 drafter for a cache (shared by ``families/test_chain_eagle3.py`` and the conformance kit).

The loop: each cycle the target runs over the whole sequence (no caches; the verify pass, whose states of the
committed tokens are the next cycle's context, ``chain_reference.LastPass``), its states captured as SGLang's
``set_eagle3_layers_to_capture`` captures them (the residual stream entering layer ``i + 1``, by forward
pre-hooks), the drafter's context rebuilt from them (row t: the state at t and the token at t + 1), and K steps
run through SpecForge's own ``backbone`` / ``compute_logits`` with its test-time-training cache, the draft mapped
by ``d2t`` (``chain_reference.greedy_loop``). SpecForge's rotary helpers and norms are ``torch.compile``d; the
oracle runs them eagerly.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from oracles import require

llama3_eagle = require("specforge.modeling.draft.llama3_eagle")  # a missing oracle fails, never skips

MAX_NEW = 30
EAGLE_IDS = [1, 3, 4]  # SpecForge's default for an 8-layer target: outputs of layers 1, L // 2 - 1, L - 4
DRAFT_VOCAB = 64


def eagle_config(layer_ids: list[int] = EAGLE_IDS, **extra) -> dict:
    """A SpecForge draft config (``LlamaConfig`` fields, ``draft_vocab_size``, ``eagle_config`` naming
    ``layer_ids``)."""
    return {**dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", vocab_size=128,
                   draft_vocab_size=DRAFT_VOCAB, hidden_size=48, target_hidden_size=32, intermediate_size=64,
                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
                   rms_norm_eps=1e-6, max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False,
                   rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids)}), **extra}


def specforge_module(config: dict, state: dict[str, torch.Tensor]):
    """SpecForge's ``LlamaForCausalLMEagle3`` built from its config (its ``from_pretrained`` leaves the rotary
    caches unset under transformers 5) with ``state``."""
    from transformers import LlamaConfig

    sf = llama3_eagle.LlamaForCausalLMEagle3(LlamaConfig.from_dict(config)).eval()
    sf.load_state_dict(state, strict=True)
    return sf


def draft_vocabulary(cache) -> list[int]:
    """Target ids of the draft vocabulary: the completions' tokens but their fifth most common, then the lowest
    unseen ids (SpecForge's mapping keeps the most frequent tokens; one left out makes some drafts impossible)."""
    seen = Counter(t for e in cache.samples for t in cache.load(e.id).input_ids[e.prompt_len:].tolist())
    common = [t for t, _ in seen.most_common()]
    keep = [t for t in common if t != common[4]][:DRAFT_VOCAB]
    rest = [t for t in range(128) if t not in seen]
    return sorted(keep + rest[:DRAFT_VOCAB - len(keep)])


def train_eagle3(drafter, cache, epochs: int = 8, lr: float = 1e-2):
    """Teacher-forced first-step training (row t predicts the token at t + 2 in the draft vocabulary; tokens
    outside it are not supervised), through the replay's own context pass."""
    from dflash_cb.core.drafters.chain import ChainRunner

    runner = ChainRunner(drafter, drafter.spec)
    columns = cache.feature_columns(drafter.spec.target_layer_ids)
    index = torch.full((128,), -100, dtype=torch.long)
    index[torch.arange(DRAFT_VOCAB) + drafter.d2t] = torch.arange(DRAFT_VOCAB)
    opt = torch.optim.AdamW([p for n, p in drafter.named_parameters() if n != "embed_tokens.weight"], lr=lr)
    data = [cache.load(e.id) for e in cache.samples]
    for _ in range(epochs):
        for s in data:
            ids = s.input_ids.long()
            r = ids.numel() - 2
            feats = (s.hidden if columns is None else s.hidden.index_select(1, columns))[:r].float()
            ctx = runner.context(iter([(feats, drafter.embed(ids[1:r + 1], None))]), [r])
            loss = torch.nn.functional.cross_entropy(drafter.lm_head(ctx.head_in), index[ids[2:r + 2]])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.eval()


def trained_drafter(config: dict, cache, embed: torch.Tensor | None = None, seed: int = 0):
    """A drafter of ``config`` with the cache's draft vocabulary (``draft_vocabulary``), its embedding ``embed``
    when given (SpecForge's frozen copy of the target's), trained briefly (``train_eagle3``)."""
    from dflash_cb.core.drafters.layouts import drafter_from_config

    torch.manual_seed(seed)
    drafter = with_draft_vocabulary(drafter_from_config(config), cache)
    if embed is not None:
        drafter.embed_tokens.weight.data.copy_(embed)
    return train_eagle3(drafter, cache)


def with_draft_vocabulary(drafter, cache):
    """``drafter`` with the cache's draft vocabulary (``draft_vocabulary``) in its ``d2t`` / ``t2d`` tables."""
    vocab = torch.tensor(draft_vocabulary(cache))
    drafter.d2t.copy_(vocab - torch.arange(DRAFT_VOCAB))
    drafter.t2d.zero_()
    drafter.t2d[vocab] = True
    return drafter


@contextlib.contextmanager
def sglang_capture(target, layer_ids: list[int] = EAGLE_IDS) -> Iterator[dict[int, torch.Tensor]]:
    """The target's EAGLE-3 states as SGLang's ``set_eagle3_layers_to_capture`` takes them: for each id ``i``, the
    residual stream entering decoder layer ``i + 1`` (forward pre-hooks), [1, T, H] per id, of the last pass."""
    captured: dict[int, torch.Tensor] = {}

    def capture(i: int):
        def hook(module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [target.model.layers[i + 1].register_forward_pre_hook(capture(i), with_kwargs=True) for i in layer_ids]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def specforge_generate(sf, target, prompt: list[int], stop_token_ids, steps: int, tail: str,
                       max_new_tokens: int = MAX_NEW) -> list[int]:
    """Tokens committed per cycle with SpecForge's module drafting (module docstring), its layers the ones its
    config names."""
    layer_ids = list(sf.config.eagle_config["eagle_aux_hidden_state_layer_ids"])
    from chain_reference import LastPass, greedy_loop

    def target_pass(tokens: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The target's argmax at every position and the states ``captured`` in that pass."""
        argmax = target(input_ids=torch.tensor([tokens])).logits[0].argmax(-1)
        return argmax, {i: captured[i] for i in layer_ids}

    passes = LastPass(target_pass, target, ("eagle3", tuple(layer_ids)))  # the last verify pass's states

    def propose(ids: list[int], k: int) -> list[int]:
        rows = len(ids) - 1  # row t: the target's states at t, the token at t + 1
        states = passes.over(ids[:rows])[1]
        aux = torch.cat([states[i][:, :rows] for i in layer_ids], dim=-1)
        hidden = sf.project_hidden_states(aux)
        mask = sf.prepare_decoder_attention_mask(torch.ones(1, rows), hidden, 1, rows, 0)
        tokens = torch.tensor([ids[1:]])
        cache_hidden: list[list[torch.Tensor]] = [[], []]
        drafts: list[int] = []
        for _ in range(k):
            hidden = sf.backbone(input_embeds=sf.embed_input_ids(tokens), hidden_states=hidden,
                                 cache_hidden=cache_hidden, attention_mask=mask,
                                 position_ids=torch.arange(rows)[None])
            d = int(sf.compute_logits(hidden)[0, -1].argmax())
            drafts.append(d + int(sf.d2t[d]))
            tokens = torch.cat([tokens[:, 1:], torch.tensor([[drafts[-1]]])], dim=1)  # TTT's shift
        return drafts

    with sglang_capture(target, layer_ids) as captured, torch._dynamo.config.patch(disable=True):
        return greedy_loop(lambda tokens: passes.run(tokens)[0], propose, prompt, max_new_tokens, stop_token_ids,
                           steps, tail)
