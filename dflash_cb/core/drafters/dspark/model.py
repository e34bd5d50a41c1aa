"""A DSpark drafter (SpecForge 0.2.0's ``DSparkDraftModel`` format): DFlash's backbone and weights, plus a Markov
head that adds a low-rank bias of the previous token to each depth's logits, and an optional confidence head.

The draft at depth k is ``argmax(head(h_k) + W2(c_k))``: ``x_{k-1}`` the token chosen before it (the verified token
at depth 1) and ``c_k`` its code: ``W1[x_{k-1}]`` for the ``vanilla`` head, ``sigmoid(G [h_k; W1[x_{k-1}]])`` times
it for the ``gated`` one, and for the ``rnn`` one ``tanh`` of a third of ``J [s_{k-1}; W1[x_{k-1}]; h_k]``, where the
state ``s`` starts at zero on each block and moves one depth at a time (a gated blend of itself and a candidate from
the same projection). Every depth's draft depends only on the backbone's states up to k and the tokens chosen before
k, so the teacher-forced drafts' leading matches are the loop's accepted length (docs/method.md): the rnn head's
state is scanned over the block's teacher-forced tokens once per block (``MarkovProposer.prefix_state``). The
confidence head predicts each depth's acceptance for confidence-scheduled verification; it plays no part in the
full-block greedy loop replayed here; its calibration is measured (``figures``: its sigmoid at each depth's row, the
previous token's Markov code appended when ``confidence_head_with_markov``, as SpecForge's ``predict_confidence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Qwen3Config

from ..block.drafter import BlockDrafter
from ..proposers import Proposer, RowDrafts, logit_chunks
from ..spec import DrafterSpec, config_value

ARCHITECTURE = "DSparkDraftModel"
HEAD_TYPES = ("vanilla", "gated", "rnn")  # SpecForge 0.2.0's Markov heads (``build_markov_head``)


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
            raise ValueError(f"DSpark drafter config: markov_head_type {kind!r}: SpecForge 0.2.0 builds "
                             f"{', '.join(HEAD_TYPES)}")
        alpha = float(config_value(config, "confidence_head_alpha", 0.0) or 0.0)
        confidence = bool(config_value(config, "enable_confidence_head", alpha > 0.0))
        return cls(int(rank), kind, confidence, bool(config_value(config, "confidence_head_with_markov", False)))


class MarkovHead(nn.Module):
    """``markov_w1`` [V, r] (the previous token's code), ``markov_w2`` [r -> V] (its logit bias) and, gated,
    ``gate_proj`` [H + r -> r]; rnn, ``joint_proj`` [r + r + H -> 3r] (gate, candidate, output): the published
    weight names."""

    def __init__(self, hidden: int, vocab: int, settings: DSparkSettings):
        super().__init__()
        rank = settings.markov_rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        self.gated = settings.markov_head_type == "gated"
        self.recurrent = settings.markov_head_type == "rnn"
        if self.gated:
            self.gate_proj = nn.Linear(hidden + rank, rank)
        if self.recurrent:
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def _step(self, state: torch.Tensor, code: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rnn head at one depth: (the state after it, the code its bias projects)."""
        gate, candidate, out = self.joint_proj(torch.cat([state, code, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return gate * state + (1.0 - gate) * torch.tanh(candidate), torch.tanh(out)

    def states(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The rnn head's state before each depth [N, D, r] of blocks whose tokens before each depth are
        ``previous`` [N, D] and states ``hidden`` [N, D, H]: zero at depth 1, then one step per depth."""
        code = self.markov_w1(previous.clamp(min=0))
        hidden = hidden.to(code.dtype)
        out = [torch.zeros_like(code[:, 0])]
        for k in range(1, previous.shape[1]):  # sequential over the block, batched over its blocks
            out.append(self._step(out[-1], code[:, k - 1], hidden[:, k - 1])[0])
        return torch.stack(out, dim=1)

    def bias(self, previous: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """The logit bias [M, V] of rows whose previous token is ``previous`` [M], state ``hidden`` [M, H] and, for
        the rnn head, its state before the row's depth ``state`` [M, r] (``states``)."""
        code = self.markov_w1(previous.clamp(min=0))
        hidden = hidden.to(code.dtype)
        if self.gated:
            code = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1))) * code
        elif self.recurrent:
            if state is None:
                raise ValueError("the rnn Markov head reads its state before each depth (MarkovHead.states)")
            code = self._step(state.to(code.dtype), code, hidden)[1]
        return self.markov_w2(code)

    def block_bias(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The bias [N, D, V] of whole blocks (``previous`` [N, D], ``hidden`` [N, D, H]): what training reads."""
        n, d = previous.shape
        state = self.states(previous, hidden).reshape(n * d, -1) if self.recurrent else None
        return self.bias(previous.reshape(-1), hidden.reshape(n * d, -1), state).view(n, d, -1)


class ConfidenceHead(nn.Module):
    """``proj`` [H (+ r) -> 1]: the predicted acceptance's logit (SpecForge's ``AcceptRatePredictor``)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


def predicted_acceptance(confidence: nn.Module, markov: MarkovHead | None, previous: torch.Tensor,
                         hidden: torch.Tensor) -> torch.Tensor:
    """The confidence head's predicted acceptance [M] (float32) of rows with states ``hidden`` [M, H] and previous
    tokens ``previous`` [M], whose Markov code is appended when ``markov`` is given (``confidence_head_with_markov``)."""
    w = confidence.proj.weight
    features = hidden.to(w.dtype)
    if markov is not None:
        features = torch.cat([features, markov.markov_w1(previous.clamp(min=0)).to(w.dtype)], dim=-1)
    return torch.sigmoid(confidence.proj(features).squeeze(-1).float())


class DSparkDrafter(BlockDrafter):
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
    target's own token under teacher forcing: ``previous``); the rnn head's state is scanned once per block over
    the teacher-forced tokens and the backbone's states (``prefix_state``). No DDTree: a tree of the head's top-K
    per depth is not the tree of a drafter whose every depth depends on its parent token."""

    def __init__(self, spec: DrafterSpec, lm_head: torch.Tensor, mem_bytes: int, head: MarkovHead,
                 confidence: nn.Module | None = None, confidence_with_markov: bool = False):
        from .figures import FIGURES

        super().__init__(spec, lm_head, mem_bytes, FIGURES)
        self.head, self.confidence, self.confidence_with_markov = head, confidence, confidence_with_markov
        self.prefix_reads_hidden = head.recurrent

    def prefix_state(self, previous: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        if not self.head.recurrent:
            return None
        with torch.autocast(previous.device.type, enabled=False):
            return self.head.states(previous, hidden)

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        tokens = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        plain = torch.empty_like(tokens)  # the head's argmax alone: the walk with the Markov head off
        for rows, logits in logit_chunks(hidden, self.lm_head, self.spec, self.mem_bytes):
            with torch.autocast(hidden.device.type, enabled=False):
                bias = self.head.bias(previous[rows], hidden[rows], None if state is None else state[rows])
            plain[rows] = logits.argmax(-1)
            # In place (the chunk's logits are its own): the same float32 sums, one [rows, vocab] pass fewer.
            tokens[rows] = logits.add_(bias.float()).argmax(-1)
        hits = (plain == target)[:, None]
        return RowDrafts(tokens, hits, self._calibration(hidden, previous, tokens == target), None, None, None)

    def _calibration(self, hidden: torch.Tensor, previous: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
        """The rows' confidence counts [M, 1 + 2 * BINS] (``figures.FIGURES.depth_counts``): the prediction in
        thousandths, its bin, its bin where the draft matched; zeros without a confidence head."""
        from .figures import BINS, MILLI

        counts = torch.zeros((hidden.shape[0], 1 + 2 * BINS), dtype=torch.long, device=hidden.device)
        if self.confidence is None:
            return counts
        with torch.autocast(hidden.device.type, enabled=False):
            p = predicted_acceptance(self.confidence, self.head if self.confidence_with_markov else None, previous,
                                     hidden)
        milli = torch.round(p.double() * MILLI).long()
        in_bin = torch.nn.functional.one_hot((milli * BINS // MILLI).clamp(max=BINS - 1), BINS)
        counts[:, 0] = milli
        counts[:, 1:1 + BINS] = in_bin
        counts[:, 1 + BINS:] = in_bin * match[:, None]
        return counts
