"""An independent greedy speculative loop that drafts a full block every cycle (the test oracle of
``tail_blocks="served"``, and what the fake SGLang server in test_served.py runs).

Written from the serving side's description (docs/method.md, "Tail blocks"): every cycle drafts
``block_size - 1`` tokens after the last verified one, the target verifies them all, and the
committed run (accepted drafts, then the target's bonus token) is cut afterwards, at a stop token
or at ``max_new_tokens``. No key/value caches, no engine code: the target runs on the whole sequence
(the committed tokens and the block) once a cycle, and that pass's states of the tokens the cycle
commits are the next cycle's context, as a server's verify pass gives them (``chain_reference.LastPass``);
the drafter module (``dflash.model.DFlashDraftModel``) sees the context features and one full block;
its drafts are the head's argmax, or what ``propose`` makes of the block's hidden states (a DFlash 2
drafter: its ``propose``, the selector's walk). Slow, and only meant for tiny models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from chain_reference import LastPass


@dataclass
class FullBlockRun:
    output_ids: list[int]  # the completion, prefill token first
    acceptance_lengths: list[int]  # tokens committed per cycle, after the cut
    correct_drafts: list[int]  # drafts equal to the target's token per cycle, before the cut (SGLang's count)
    drafts: list[list[int]]  # the drafted tokens (depths 1 .. block_size - 1) per cycle


@torch.no_grad()
def full_block_generate(draft: torch.nn.Module, target: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int,
                        stop_token_ids: Sequence[int], layer_ids: Sequence[int], block_size: int,
                        mask_token_id: int,
                        propose: Callable[[torch.Tensor, int], list[int]] | None = None) -> FullBlockRun:
    ids = [int(t) for t in prompt]
    n = len(ids)
    end = n + max_new_tokens
    stops = set(stop_token_ids)
    embed = target.get_input_embeddings().weight
    head = target.lm_head

    passes = LastPass(lambda tokens: target(torch.tensor([tokens]), output_hidden_states=True))
    target_pass = passes.run

    ids.append(int(target_pass(ids).logits[0, -1].argmax()))
    lengths: list[int] = []
    correct: list[int] = []
    drafted: list[list[int]] = []
    while len(ids) < end and ids[-1] not in stops:
        p = len(ids) - 1  # the anchor: the last verified token
        hs = passes.over(ids[:p]).hidden_states
        context = torch.cat([hs[i + 1][:, :p] for i in layer_ids], dim=-1)  # output of decoder layer i
        block = torch.tensor([[ids[p]] + [mask_token_id] * (block_size - 1)])
        noise = torch.nn.functional.embedding(block, embed)  # no input_embedding_scale: the server ignores it
        hidden = draft(target_hidden=context, noise_embedding=noise,
                       position_ids=torch.arange(p + block_size)[None])[:, 1:, :]
        drafts = head(hidden)[0].argmax(-1).tolist() if propose is None else propose(hidden, ids[p])
        drafted.append(drafts)
        verify = target_pass(ids[: p + 1] + drafts).logits[0, p:].argmax(-1).tolist()  # tokens at p+1 .. p+B
        a = 0
        while a < block_size - 1 and drafts[a] == verify[a]:
            a += 1
        correct.append(a)
        kept: list[int] = []
        for t in drafts[:a] + [verify[a]]:
            kept.append(t)
            if t in stops or p + 1 + len(kept) >= end:
                break
        ids += kept
        lengths.append(len(kept))
    return FullBlockRun(ids[n:], lengths, correct, drafted)
