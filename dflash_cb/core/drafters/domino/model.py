"""A Domino drafter (SpecForge 0.2.0's ``DominoDraftModel`` format): DFlash's backbone and weights, plus a
bias-free one-layer GRU over the embeddings of the block's tokens so far (``prefix_gru``) and a projection of
``[h_k; gru_{k-1}]`` to the vocabulary (``embed_proj``: Linear, SiLU, Linear) added to the head's logits.

The draft at depth k is ``argmax(head(h_k) + embed_proj([h_k; g_{k-1}]))`` with ``g_{k-1}`` the GRU's output after
the tokens before depth k (the verified token, then the drafts), from depth ``1 + pure_draft_prefix_len`` on (the
head's alone before it). It depends only on the backbone's state at k and the tokens chosen before k, so the
teacher-forced drafts' leading matches are the loop's accepted length (docs/method.md). With ``shift_label`` each
block position predicts the token after it (SpecForge trains position j on the token j + 1 places after the anchor):
the draft at depth k reads the backbone's state at k - 1 (the anchor's at depth 1), and the head's logits there, with
the same GRU summary of the tokens before k, corrected from depth ``1 + pure_draft_prefix_len`` on as without it.
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

ARCHITECTURE = "DominoDraftModel"


@dataclass(frozen=True)
class DominoSettings:
    emb_dim: int
    gru_hidden_dim: int
    pure_draft_prefix_len: int
    shift_label: bool = False

    @classmethod
    def of(cls, config: Any) -> DominoSettings:
        values = {}
        for name in ("emb_dim", "gru_hidden_dim"):
            v = config_value(config, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Domino drafter config: dflash_config.{name} is {v!r}; it must be a positive integer")
            values[name] = v
        prefix = config_value(config, "pure_draft_prefix_len", 0) or 0
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"Domino drafter config: pure_draft_prefix_len is {prefix!r}; give a count >= 0")
        shift = bool(config_value(config, "shift_label", False))  # read as SpecForge reads it
        return cls(values["emb_dim"], values["gru_hidden_dim"], int(prefix), shift)


class DominoDrafter(BlockDrafter):
    """DFlash's module plus ``prefix_gru.*`` and ``embed_proj.*``."""

    family: ClassVar[str] = "domino"

    def __init__(self, config: Qwen3Config):
        settings = DominoSettings.of(config)  # before any weight is allocated
        super().__init__(config)
        self.settings = settings
        self.prefix_gru = nn.GRU(config.hidden_size, settings.gru_hidden_dim, num_layers=1, batch_first=True,
                                 bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(config.hidden_size + settings.gru_hidden_dim, settings.emb_dim,
                                                  bias=False), nn.SiLU(),
                                        nn.Linear(settings.emb_dim, config.vocab_size, bias=False))

    def _published_config(self) -> Qwen3Config:
        return self.family_config()


class DominoProposer(Proposer):
    """The GRU over each block's teacher-forced predecessors once (``prefix_state``), then per row the head's
    logits plus the correction of its state and its predecessors' summary; with ``shift_label`` a depth's row is
    the block position before it (``position_shift``). No DDTree (each depth depends on the tokens before it)."""

    def __init__(self, spec: DrafterSpec, lm_head: torch.Tensor, mem_bytes: int, module: DominoDrafter,
                 embed: torch.Tensor):
        from .figures import FIGURES

        super().__init__(spec, lm_head, mem_bytes, FIGURES)
        self.module, self.embed = module, embed
        self.position_shift = int(module.settings.shift_label)

    def prefix_state(self, previous: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        gru = self.module.prefix_gru
        with torch.autocast(previous.device.type, enabled=False):
            inputs = torch.nn.functional.embedding(previous.clamp(min=0), self.embed).to(gru.weight_ih_l0.dtype)
            out = gru(inputs)[0]  # [N, D, G]: out[:, k - 1] summarises the tokens before depth k
        # The last column says whether the depth is corrected (from 1 + pure_draft_prefix_len on).
        depth = torch.arange(1, previous.shape[1] + 1, device=previous.device)
        corrected = (depth >= 1 + self.module.settings.pure_draft_prefix_len).to(out.dtype)
        return torch.cat([out, corrected[None, :, None].expand(out.shape[0], -1, 1)], dim=-1)

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        tokens = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        plain = torch.empty_like(tokens)  # the head's argmax alone: the walk with the correction off
        proj = self.module.embed_proj
        for rows, logits in logit_chunks(hidden, self.lm_head, self.spec, self.mem_bytes):
            s = state[rows]
            with torch.autocast(hidden.device.type, enabled=False):
                w = proj[0].weight
                fix = proj(torch.cat([hidden[rows].to(w.dtype), s[:, :-1].to(w.dtype)], dim=-1))
            plain[rows] = logits.argmax(-1)
            # In place (the chunk's logits are its own): one [rows, vocab] pass fewer, the same sums in float32.
            corrected = logits.add_(fix.float()).argmax(-1)
            tokens[rows] = torch.where(s[:, -1] > 0, corrected, plain[rows])
        hits = (plain == target)[:, None]
        return RowDrafts(tokens, hits, hits[:, :0], None, None, None)
