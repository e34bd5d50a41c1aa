"""A DSpark drafter (SpecForge 0.2.0's ``DSparkDraftModel`` format): DFlash's backbone and weights, plus a Markov
head that adds a low-rank bias of the previous token to each depth's logits, and an optional confidence head.

The draft at depth k is ``argmax(head(h_k) + W2(g * W1[x_{k-1}]))``: ``x_{k-1}`` the token chosen before it (the
verified token at depth 1), ``g`` 1 for the ``vanilla`` head and ``sigmoid(G [h_k; W1[x_{k-1}]])`` for the ``gated``
one. It depends only on the backbone's state at k and the previous token, so the teacher-forced drafts' leading
matches are the loop's accepted length (docs/method.md). The ``rnn`` head carries a state across the block's depths
and is refused. The confidence head predicts each depth's acceptance for confidence-scheduled verification; it is
loaded and kept, and plays no part in the full-block greedy loop replayed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Qwen3Config

from ..dflash.model import DFlashDrafter
from ..proposers import Proposer, RowDrafts, logit_chunks
from ..spec import DrafterSpec, config_value

ARCHITECTURE = "DSparkDraftModel"
HEAD_TYPES = ("vanilla", "gated")  # the Markov heads replayed; "rnn" recurs over the block and is refused


@dataclass(frozen=True)
class DSparkSettings:
    """The ``dflash_config`` fields of a DSpark drafter."""

    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_with_markov: bool

    @classmethod
    def of(cls, config: Any) -> DSparkSettings:
        rank = config_value(config, "markov_rank", 0) or 0
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"DSpark drafter config: dflash_config.markov_rank is {rank!r}; the replay needs a Markov "
                             "head (a positive rank)")
        kind = str(config_value(config, "markov_head_type", "vanilla")).lower()
        if kind not in HEAD_TYPES:
            raise ValueError(f"DSpark drafter config: markov_head_type {kind!r}: the replay takes {', '.join(HEAD_TYPES)}"
                             " (an rnn head carries a state across the block's depths; not replayed)")
        alpha = float(config_value(config, "confidence_head_alpha", 0.0) or 0.0)
        confidence = bool(config_value(config, "enable_confidence_head", alpha > 0.0))
        return cls(int(rank), kind, confidence, bool(config_value(config, "confidence_head_with_markov", False)))


class MarkovHead(nn.Module):
    """``markov_w1`` [V, r] (the previous token's code), ``markov_w2`` [r -> V] (its logit bias) and, gated,
    ``gate_proj`` [H + r -> r]: the published weight names."""

    def __init__(self, hidden: int, vocab: int, settings: DSparkSettings):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, settings.markov_rank)
        self.markov_w2 = nn.Linear(settings.markov_rank, vocab, bias=False)
        self.gated = settings.markov_head_type == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(hidden + settings.markov_rank, settings.markov_rank)

    def bias(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The logit bias [M, V] of rows whose previous token is ``previous`` [M] and state ``hidden`` [M, H]."""
        code = self.markov_w1(previous.clamp(min=0))
        if self.gated:
            code = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(code.dtype), code], dim=-1))) * code
        return self.markov_w2(code)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDrafter(DFlashDrafter):
    """DFlash's module plus ``markov_head.*`` and, when the config enables it, ``confidence_head.*``."""

    family: ClassVar[str] = "dspark"

    def __init__(self, config: Qwen3Config):
        settings = DSparkSettings.of(config)  # before any weight is allocated
        super().__init__(config)
        self.settings = settings
        self.markov_head = MarkovHead(config.hidden_size, config.vocab_size, settings)
        if settings.confidence_head:
            self.confidence_head = ConfidenceHead(config.hidden_size + (settings.markov_rank
                                                                        if settings.confidence_with_markov else 0))

    def _published_config(self) -> Qwen3Config:
        return self.family_config()


class MarkovProposer(Proposer):
    """The draft at a depth is the argmax of the head's logits plus the Markov head's bias of the predecessor (the
    target's own token under teacher forcing: ``previous``). No DDTree: a tree of the head's top-K per depth is not
    the tree of a drafter whose every depth depends on its parent token."""

    def __init__(self, spec: DrafterSpec, lm_head: torch.Tensor, mem_bytes: int, head: MarkovHead):
        from .figures import FIGURES

        super().__init__(spec, lm_head, mem_bytes, FIGURES)
        self.head = head

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        tokens = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        plain = torch.empty_like(tokens)  # the head's argmax alone: the walk with the Markov head off
        for rows, logits in logit_chunks(hidden, self.lm_head, self.spec, self.mem_bytes):
            with torch.autocast(hidden.device.type, enabled=False):
                bias = self.head.bias(previous[rows], hidden[rows])
            plain[rows] = logits.argmax(-1)
            tokens[rows] = (logits + bias.float()).argmax(-1)
        hits = (plain == target)[:, None]
        return RowDrafts(tokens, hits, hits[:, :0], None, None, None)
