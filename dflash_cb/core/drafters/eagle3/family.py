"""EAGLE-3 (SpecForge 0.2.0's ``LlamaForCausalLMEagle3``, served by SGLang and vLLM as a chain at ``topk`` 1):
a chain drafter over three target layers with its own embedding, head and draft vocabulary."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..chain import ChainFamily
from ..proposers import Proposer
from ..spec import DrafterSpec
from .figures import FIGURES, SIMULATED_ACC_LEN, position_acc_key
from .model import ARCHITECTURE, EMBED_KEY, FAMILY_NAME


class Eagle3Family(ChainFamily):
    name = FAMILY_NAME
    label = "EAGLE-3"
    architecture = ARCHITECTURE
    served_methods = ("EAGLE3",)  # SGLang's --speculative-algorithm EAGLE3, vLLM's method "eagle3"
    optional_keys = (EMBED_KEY,)  # SGLang's export, published folders and SpecForge's checkpoints leave it out
    figures = FIGURES

    def module_class(self) -> type[nn.Module]:
        from .model import Eagle3Drafter

        return Eagle3Drafter

    def build(self, config: dict[str, Any], keys: Iterable[str] | None = None) -> nn.Module:
        """SGLang's export and published EAGLE-3 folders leave out ``embed_tokens``: the servers embed with the
        target's table (SpecForge trains a frozen copy of it), and so does the drafter built for them."""
        from .model import Eagle3Drafter

        return Eagle3Drafter(dict(config), own_embedding=keys is None or EMBED_KEY in set(keys))

    def tiny_config(self, target_config: dict[str, Any], layer_ids: Sequence[int],
                    speculative_tokens: int) -> dict[str, Any]:
        """SpecForge's layout, one layer, over the target's whole vocabulary (no draft-vocabulary mapping), reading
        three of the cache's layers other than its last: EAGLE-3 reads the residual stream SGLang captures, and the
        cache holds the last layer final-normed (the state a block drafter and the MTP head read). With fewer, the
        last of them is read again (a tiny target's layers 0, 1, 1)."""
        inner = [int(i) for i in layer_ids if int(i) != max(layer_ids)] or [int(min(layer_ids))]
        layers = (inner + [inner[-1]] * 3)[:3]
        vocab, hidden = int(target_config["vocab_size"]), int(target_config["hidden_size"])
        return {"architectures": [ARCHITECTURE], "drafter_family": FAMILY_NAME, "model_type": "llama",
                "vocab_size": vocab, "draft_vocab_size": vocab, "hidden_size": hidden, "target_hidden_size": hidden,
                "intermediate_size": 3 * hidden, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096, "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}, "target_layer_ids": layers,
                "num_target_layers": int(target_config["num_hidden_layers"]),
                "num_speculative_tokens": int(speculative_tokens)}

    def target_layers(self, config: Any) -> list[int]:
        from .model import eagle_layer_ids

        return eagle_layer_ids(config)

    def own_figures(self, cache: Any, drafter: Any, block_size: int, sample_ids: Sequence[str],
                    head: Any = None) -> dict[str, float]:
        """SpecForge's ``simulated_acc_len`` and per-position accuracy over the chain's K = block - 1 steps."""
        from .accuracy import cache_position_counts

        module = drafter if isinstance(drafter, self.module_class()) else self.adopt(drafter)
        if module is None:
            return {}
        counts = cache_position_counts(cache, module, block_size - 1, sample_ids=sample_ids, head=head)
        out = {SIMULATED_ACC_LEN: counts.simulated_acc_len}
        out.update({position_acc_key(k + 1): acc for k, acc in enumerate(counts.per_position_acc)})
        return out

    def tree_refusal(self) -> str:
        return ("an EAGLE-3 drafter drafts each depth from its parent token: served with topk > 1 (SGLang's "
                "--speculative-eagle-topk, vLLM's speculative_token_tree) it is verified as EAGLE's own top-k "
                "tree, reranked to num_draft_tokens, which is not replayed, and a DDTree of per-depth top-K is no "
                "tree a server verifies; what is scored is the chain (topk 1)")

    def own_key(self, keys: Iterable[str]) -> str | None:
        return next((k for k in keys if k.startswith("midlayer.")), None)

    def adopt(self, module: nn.Module) -> nn.Module | None:
        """Ours sharing the weights of a module in SpecForge's layout (its ``LlamaForCausalLMEagle3``)."""
        config = getattr(module, "config", None)
        if config is None or not self.config_says(config):
            return None
        state = module.state_dict()
        try:
            with torch.device("meta"):
                ours = self.module_class()(config)
        except (ValueError, KeyError, TypeError):  # e.g. a config naming no target layers
            return None
        if set(ours.state_dict()) != set(state):
            return None
        ours.load_state_dict(state, assign=True, strict=True)
        # Non-persistent buffers (the rotary inv_freq) are not in a state dict: rebuild them for real.
        ours.rotary_emb = type(ours.rotary_emb)(ours.config).to(next(iter(state.values())).device)
        return ours

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        from .model import DraftVocabProposer

        if getattr(module, "d2t", None) is None:
            raise ValueError("an EAGLE-3 drafter is scored through its module (its lm_head and d2t)")
        return DraftVocabProposer(spec, lm_head, mem_bytes, module, self.figures)


FAMILY = Eagle3Family()
