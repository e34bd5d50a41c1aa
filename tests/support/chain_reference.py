"""An independent greedy speculative loop for the target's own MTP head (Qwen3.5 / Qwen3.6), wired as vLLM's
``qwen3_5_mtp.py`` and its EAGLE proposer run it: the test oracle of the chain replay.

No engine code. Every cycle: the target runs on the whole sequence (no caches), and the MTP's context is rebuilt
from that pass's final-normed hidden states of the committed tokens (row t: the token at t + 1 and the state at t,
position t; the last verify pass's, as a server's: ``LastPass``), with transformers' own ``Qwen3_5DecoderLayer``
and a ``DynamicCache``; its last row is the first step; each later step is fed its own draft and the MTP's normed
output one position further on. The target verifies the drafts and commits the accepted ones and its own next
token (``greedy_loop``, shared with the EAGLE-3 oracle in ``families/test_chain_eagle3.py``; ``chain_cache``
builds both tests' cache). Slow; tiny models only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch


class ReferenceMtp(torch.nn.Module):
    """The ``mtp.*`` weights of a target checkpoint in transformers' modules (names as the checkpoint's)."""

    def __init__(self, text_config, state: dict[str, torch.Tensor]):
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
            Qwen3_5TextRotaryEmbedding,
        )

        super().__init__()
        cfg = type(text_config).from_dict({**text_config.to_dict(), "num_hidden_layers": 1,
                                           "layer_types": ["full_attention"]})
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(cfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(cfg)
        self.cfg = cfg
        self.load_state_dict({k.removeprefix("mtp."): v for k, v in state.items()}, strict=True)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """[1, n, H] embeddings and fed states at ``positions`` [n] -> the normed outputs [1, n, H]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        pe = self.rotary(x, positions[None])
        past = cache.get_seq_length()
        n = x.shape[1]
        # Causal over the cache's rows and these ones.
        allowed = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
        out = self.layers[0](x, position_embeddings=pe, attention_mask=mask, cache=cache)
        return self.norm(out)


# target module -> {(what a pass keeps, its tokens): the pass}: a pass is a function of the target's weights and the
# tokens, so loops over one target in a session (the same prompts at another tail convention or chain length) share
# their passes instead of running them again. Weak: a target no test holds drops its passes.
_PASSES: WeakKeyDictionary = WeakKeyDictionary()


class LastPass:
    """The target's last pass over a token list (no caches), kept: its states at positions before t are those of a
    pass over the first t of its tokens, as attention is causal (later tokens change no earlier state). A loop's
    verify pass so gives the next cycle's context, as a server's does, and the target runs once a cycle. Given
    the ``target`` module and ``what`` the pass keeps, a pass over the same tokens is run once a session
    (``_PASSES``); ``forward`` must then return all it reads (no side effect)."""

    def __init__(self, forward: Callable[[list[int]], Any], target: torch.nn.Module | None = None,
                 what: Any = None):
        self.forward, self.tokens, self.out = forward, [], None
        self.memo, self.what = (None if target is None else _PASSES.setdefault(target, {})), what

    def run(self, tokens: list[int]) -> Any:
        key = (self.what, tuple(tokens))
        if self.memo is None:
            out = self.forward(tokens)
        elif key in self.memo:
            out = self.memo[key]
        else:
            out = self.memo[key] = self.forward(tokens)
        self.tokens, self.out = list(tokens), out
        return out

    def over(self, prefix: list[int]) -> Any:
        """The last pass if it began with ``prefix`` (read its states up to ``len(prefix)``), else a pass over it."""
        return self.out if self.tokens[:len(prefix)] == list(prefix) else self.run(prefix)


@torch.no_grad()
def mtp_generate(mtp: ReferenceMtp, target, prompt: Sequence[int], max_new_tokens: int,
                 stop_token_ids: Sequence[int], steps: int, tail: str = "served") -> list[int]:
    """Tokens committed per cycle (``greedy_loop``) with the MTP head drafting."""
    return mtp_run(mtp, target, prompt, max_new_tokens, stop_token_ids, steps, tail).lengths


@torch.no_grad()
def mtp_run(mtp: ReferenceMtp, target, prompt: Sequence[int], max_new_tokens: int,
            stop_token_ids: Sequence[int], steps: int, tail: str = "served") -> LoopRun:
    """``greedy_run`` with the MTP head drafting."""
    from transformers import DynamicCache

    text = getattr(target.model, "language_model", target.model)  # a vision-language target's text model
    embed = text.embed_tokens.weight

    def target_pass(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = text(input_ids=torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
        return out, target.lm_head(out).argmax(-1)

    passes = LastPass(target_pass, target, "mtp")

    def propose(ids: list[int], k: int) -> list[int]:
        n = len(ids)
        rows = n - 1  # row t: the token at t + 1, the state at t
        hidden, _ = passes.over(ids[:rows])
        cache = DynamicCache(config=mtp.cfg)
        out = mtp(embed[torch.tensor(ids[1:n])][None], hidden[:rows][None], torch.arange(rows), cache)
        carry = out[:, -1:]
        drafts = [int(target.lm_head(carry[0, -1]).argmax())]
        for step in range(1, k):
            carry = mtp(embed[torch.tensor([drafts[-1]])][None], carry, torch.tensor([rows - 1 + step]), cache)
            drafts.append(int(target.lm_head(carry[0, -1]).argmax()))
        return drafts

    return greedy_run(lambda tokens: passes.run(tokens)[1], propose, prompt, max_new_tokens, stop_token_ids,
                      steps, tail)


@dataclass
class LoopRun:
    output: list[int]  # the completion, the prefill's token first
    lengths: list[int]  # tokens committed per cycle, after the cut
    correct: list[int]  # drafts accepted per cycle before the cut (what a server's counters count)


def greedy_loop(greedy: Callable[[list[int]], torch.Tensor], propose: Callable[[list[int], int], list[int]],
                prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int], steps: int,
                tail: str = "served") -> list[int]:
    """Tokens committed per cycle of ``greedy_run``."""
    return greedy_run(greedy, propose, prompt, max_new_tokens, stop_token_ids, steps, tail).lengths


def greedy_run(greedy: Callable[[list[int]], torch.Tensor], propose: Callable[[list[int], int], list[int]],
               prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int], steps: int,
               tail: str = "served") -> LoopRun:
    """A greedy speculative loop (cut at a stop token or ``max_new_tokens``): ``greedy(tokens)`` is the target's
    argmax at every position of a pass over ``tokens``, ``propose(committed, k)`` a chain's k drafts. ``tail``:
    "served" drafts ``steps`` tokens every cycle; "reference" drafts no more than the completion has room for."""
    ids = [int(t) for t in prompt]
    start = len(ids)
    end = len(ids) + max_new_tokens
    stops = set(int(s) for s in stop_token_ids)
    ids.append(int(greedy(ids)[-1]))
    lengths: list[int] = []
    correct: list[int] = []
    while len(ids) < end and ids[-1] not in stops:
        n = len(ids)
        k = steps if tail == "served" else min(steps, end - n)
        drafts = propose(ids, k)
        verify = greedy(ids + drafts)
        accepted = 0
        while accepted < k and drafts[accepted] == int(verify[n - 1 + accepted]):
            accepted += 1
        correct.append(accepted)
        new = drafts[:accepted] + [int(verify[n - 1 + accepted])]
        for i, t in enumerate(new):  # the cut: a stop token or the end of the completion ends the run
            if t in stops or n + i + 1 >= end:
                new = new[:i + 1]
                break
        ids += new
        lengths.append(len(new))
    return LoopRun(ids[start:], lengths, correct)


def _precompute(target: Path, prompts: Path, out: Path, layers: Sequence[int], max_new_tokens: int, *extra: str
                ) -> Path:
    from dflash_cb.cache.precompute import main

    assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--layers",
                 ",".join(map(str, layers)), "--reference", "local", "--dtype", "float32", "--max-new-tokens",
                 str(max_new_tokens), "--no-progress", *extra]) == 0
    return out


def chain_cache(root: Path, target: Path, layers: Sequence[int], max_new_tokens: int):
    """(a cache of ``layers`` of ``target`` over five tiny prompts, the stop token it was precomputed with): a
    token two of the samples reach after six completion tokens, so some samples end at it and some at
    ``max_new_tokens``."""
    from tiny_target import random_prompts, write_prompts

    from dflash_cb.cache.states import StateCache

    prompts = write_prompts(root / "prompts.jsonl", random_prompts(5, (4, 10), seed=5, vocab=120),
                            categories=["math", "chat"])
    first = StateCache(_precompute(target, prompts, root / "plain", layers, max_new_tokens))
    seen = [set(first.load(e.id).input_ids[e.prompt_len + 6:].tolist()) for e in first.samples]
    stop = next(t for t, n in Counter(t for s in seen for t in s).most_common() if n == 2)
    out = _precompute(target, prompts, root / "cache", layers, max_new_tokens, "--stop-token-ids", str(stop))
    return StateCache(out), stop


def train_chain(drafter, cache, epochs: int = 6, lr: float = 1e-2):
    """A few epochs of the package's first-step objective (``chain.train_first_step``): partial acceptance, where
    exactness checks carry information."""
    from dflash_cb.core.drafters.chain import train_first_step

    return train_first_step(drafter, cache, epochs, lr)
