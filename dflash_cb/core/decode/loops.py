"""Greedy decoding with and without a drafter, as a server runs it for one request (docs/method.md, "The speed
check"): the target's K/V cache kept across cycles and cut back to what a cycle accepted; the drafter's own state
kept too and extended by the committed rows (a block drafter's context K/V, a chain's layer K/V). Every call is
timed, so a run says how its time splits into target passes, drafter work and what is neither (the per-cycle
overhead: acceptance, cache cuts, the tree's heap and mask).

A cycle drafts a full block (or tree, or chain) every time and cuts what it commits at a stop token or the
token limit, as SGLang and vLLM do: the replay's ``tail_blocks="served"``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drafters.chain import attend_steps
from ..drafters.proposers import ArgmaxProposer, Proposer, apply_head
from ..drafters.runners import DraftRunner
from .target_steps import DecodeError, TargetSteps
from .tree import Tree, build_tree, walk


@dataclass
class DecodeRun:
    """One request decoded: the completion (its first token is the prefill's), the tokens committed per cycle
    (empty for plain decoding) and where the seconds went after the prefill."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0  # every step or cycle, the prefill excluded (a server's per-token time)
    verify_seconds: float = 0.0  # inside target passes
    draft_seconds: float = 0.0  # inside the drafter (its context rows, its pass or steps, the head)

    @property
    def overhead_seconds(self) -> float:
        """Cycle time outside the two models' calls."""
        return max(0.0, self.seconds - self.verify_seconds - self.draft_seconds)


class Clock:
    """Seconds that include the device's queued work (a CUDA device is synchronised before each reading)."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter):
        self.cuda, self.read = torch.device(device).type == "cuda", now

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.read()


def _cut(tokens: Sequence[int], start: int, end: int, stops: set[int]) -> list[int]:
    """What a cycle commits of ``tokens`` placed from position ``start``: up to a stop token or position ``end``."""
    kept: list[int] = []
    for t in tokens:
        kept.append(int(t))
        if t in stops or start + len(kept) >= end:
            break
    return kept


@torch.inference_mode()
def plain_decode(target: TargetSteps, prompt: Sequence[int], max_new_tokens: int, stops: Sequence[int],
                 clock: Clock) -> DecodeRun:
    """Greedy decoding, one target step per token."""
    ids = [int(t) for t in prompt]
    end, stop = len(ids) + max_new_tokens, set(stops)
    ids.append(target.forward(ids).argmax[-1])
    t0 = clock()
    while len(ids) < end and ids[-1] not in stop:
        ids.append(target.forward(ids[-1:]).argmax[-1])
    run = DecodeRun(ids[len(prompt):])
    run.seconds = run.verify_seconds = clock() - t0
    return run


class LoopDrafter:
    """A drafter in a serving loop: its state over the committed rows, extended every cycle, and a proposal."""

    def start(self, features: torch.Tensor, ids: Sequence[int]) -> None:
        """The prefill: the prompt's features [p, F]; ``ids`` the prompt and the first committed token."""
        raise NotImplementedError

    def commit(self, features: torch.Tensor) -> None:
        """The features of the rows a cycle committed (the anchor and the accepted drafts)."""
        raise NotImplementedError

    def propose(self, ids: Sequence[int]) -> Tree:
        """The proposal (a block or a chain is a tree of one branch) anchored at the last of ``ids`` (the verified token)."""
        raise NotImplementedError


def _chain_tree(anchor: int, drafts: Sequence[int]) -> Tree:
    n = len(drafts)
    return Tree((anchor, *map(int, drafts)), tuple(range(n + 1)), tuple(range(-1, n)))


class BlockDrafter(LoopDrafter):
    """A block family's drafter (one pass drafts the block) through its runner and proposer; with ``tree_budget``
    the cycle's DDTree over the head's top-K per depth instead of the block."""

    def __init__(self, runner: DraftRunner, proposer: Proposer, embed: torch.Tensor, block_size: int,
                 tree_budget: int = 0):
        if tree_budget and type(proposer).tree is not ArgmaxProposer.tree:
            raise DecodeError(f"{type(proposer).__name__}: the speed check builds DDTrees over the head's top-K per "
                              "depth; this family's tree is its own (check its block, or its tree on a server)")
        self.runner, self.proposer, self.embed = runner, proposer, embed
        self.block, self.budget = block_size, tree_budget
        self.features: torch.Tensor | None = None
        self.context: Any = None
        self.dev = embed.device

    def start(self, features: torch.Tensor, ids: Sequence[int]) -> None:
        self.features = features.to(self.runner.dtype)
        self.context = self.runner.context(iter([self.features]), [self.features.shape[0]])

    def commit(self, features: torch.Tensor) -> None:
        assert self.features is not None
        new = features.to(self.runner.dtype)
        grown = self.runner.extend(self.context, new)
        self.features = torch.cat([self.features, new])
        # A runner that cannot append rows builds its context again from all of them.
        self.context = grown if grown is not None else self.runner.context(iter([self.features]),
                                                                           [self.features.shape[0]])

    def propose(self, ids: Sequence[int]) -> Tree:
        p = len(ids) - 1
        d = self.block - 1
        anchors, dev = torch.tensor([p], device=self.dev), self.dev
        tokens = torch.tensor(list(ids), dtype=torch.long, device=dev)
        emb = self.runner.block_inputs(tokens, anchors, self.block, self.embed).to(self.runner.dtype)
        blocks = self.runner.block_rows(self.context, emb, anchors, torch.zeros_like(anchors))
        read = torch.arange(1, d + 1, device=dev)[None] - self.proposer.position_shift
        hidden = blocks.rows(torch.zeros_like(read), read)[0]  # [D, H]
        anchor = int(ids[p])
        if self.budget:
            out = apply_head(hidden, self.proposer.lm_head, self.proposer.spec, self.budget, self.proposer.mem_bytes)
            assert out.topk_ids is not None and out.topk_logprobs is not None
            return build_tree(anchor, out.topk_ids.tolist(), out.topk_logprobs.double().tolist(), self.budget)
        return _chain_tree(anchor, block_drafts(self.proposer, hidden, anchor))


def block_drafts(proposer: Proposer, hidden: torch.Tensor, anchor: int) -> list[int]:
    """The block a server proposes from the block's hidden rows [D, H] (a row per depth): the family's own block
    when it builds one from its rows (``Proposer.block``), else each depth's draft, given the drafts above it
    where the family's draft reads them (``Proposer.reads_previous``)."""
    d, dev = hidden.shape[0], hidden.device
    unknown = torch.full((d,), -1, dtype=torch.long, device=dev)

    def state_of(previous: torch.Tensor) -> torch.Tensor | None:
        s = proposer.prefix_state(previous[None], hidden[None] if proposer.prefix_reads_hidden else None)
        return None if s is None else s[0]

    if type(proposer).block is not Proposer.block or not proposer.reads_previous:
        previous = torch.cat([torch.tensor([anchor], device=dev), unknown[:-1]])
        out = proposer.rows(hidden, previous, unknown, parts=True, state=state_of(previous))
        if type(proposer).block is Proposer.block:
            return out.tokens.tolist()
        return proposer.block(out.parts, out.tokens[None], torch.tensor([anchor], device=dev))[0].tolist()
    drafts: list[int] = []
    for k in range(d):  # depth k + 1 reads the drafts above it: one depth at a time
        previous = torch.tensor([anchor, *drafts] + [-1] * (d - 1 - k), dtype=torch.long, device=dev)
        state = state_of(previous)
        out = proposer.rows(hidden[k:k + 1], previous[k:k + 1], unknown[k:k + 1],
                            state=None if state is None else state[k:k + 1])
        drafts.append(int(out.tokens[0]))
    return drafts


class ChainDrafter(LoopDrafter):
    """A chain family's drafter (one step per draft, ``drafters.chain.ChainSteps``): its layer's K/V over the
    committed rows, extended by each cycle's new rows (a row needs the token after it, so the rows run up to the
    one before the anchor), then K steps, each fed the draft before it."""

    def __init__(self, runner: Any, proposer: Proposer, embed: torch.Tensor, steps: int):
        self.runner, self.proposer, self.embed, self.steps = runner, proposer, embed, steps
        self.m = runner.module
        self.features: list[torch.Tensor] = []
        self.rows = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.carry: torch.Tensor | None = None
        self.head_in: torch.Tensor | None = None

    def start(self, features: torch.Tensor, ids: Sequence[int]) -> None:
        self.features, self.rows, self.keys, self.values = [features], 0, None, None
        self._rows_to(ids, len(ids) - 1)  # the prefill's rows: all of the prompt's (the first token is known)

    def commit(self, features: torch.Tensor) -> None:
        self.features.append(features)

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        return self.runner.token_embeddings(torch.tensor(list(ids), dtype=torch.long, device=self.embed.device),
                                            self.embed)

    def _rows_to(self, ids: Sequence[int], end: int) -> None:
        """The chain's context rows up to ``end`` (exclusive): row t reads the features at t and the token t + 1."""
        if end <= self.rows:
            return
        m, r0 = self.m, self.rows
        feats = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        self.features = [feats]
        carry0 = m.first_carry(feats[r0:end].to(self.runner.dtype))
        q, k, v, kept = m.step_qkv(self._embed(ids[r0 + 1:end + 1]).to(carry0.dtype), carry0,
                                   torch.arange(r0, end, device=carry0.device))
        self.keys = k if self.keys is None else torch.cat([self.keys, k])
        self.values = v if self.values is None else torch.cat([self.values, v])
        visible = torch.arange(end, device=q.device)[None, :] <= torch.arange(r0, end, device=q.device)[:, None]
        carry, head_in = m.step_out(attend_steps(m, q, self.keys, self.values, visible), kept)
        self.carry, self.head_in, self.rows = carry[-1:], head_in[-1:], end

    def _draft(self, head_in: torch.Tensor, previous: int) -> int:
        dev = head_in.device
        out = self.proposer.rows(head_in, torch.tensor([previous], device=dev), torch.tensor([-1], device=dev))
        return int(out.tokens[0])

    def propose(self, ids: Sequence[int]) -> Tree:
        p = len(ids) - 1
        self._rows_to(ids, p)  # the rows up to the anchor's: the last one drafts depth 1
        assert self.keys is not None and self.values is not None and self.carry is not None
        m = self.m
        drafts = [self._draft(self.head_in, int(ids[p]))]
        carry = self.carry
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        visible = torch.ones((1, p), dtype=torch.bool, device=carry.device)
        for step in range(2, self.steps + 1):
            q, k, v, kept = m.step_qkv(self._embed(drafts[-1:]).to(carry.dtype), carry,
                                       torch.tensor([p + step - 2], device=carry.device))
            own_k.append(k)
            own_v.append(v)
            attended = attend_steps(m, q, self.keys[:p], self.values[:p], visible, torch.stack(own_k, dim=1),
                                    torch.stack(own_v, dim=1))
            carry, head_in = m.step_out(attended, kept)
            drafts.append(self._draft(head_in, drafts[-1]))
        return _chain_tree(int(ids[p]), drafts)


@torch.inference_mode()
def speculative_decode(target: TargetSteps, drafter: LoopDrafter, prompt: Sequence[int], max_new_tokens: int,
                       stops: Sequence[int], clock: Clock) -> DecodeRun:
    """Greedy speculative decoding: per cycle the drafter proposes from the verified token, the target verifies
    the proposal in one pass, the longest path of drafts equal to the target's tokens is accepted and the target's
    token after it added; the caches keep the accepted rows."""
    ids = [int(t) for t in prompt]
    end, stop = len(ids) + max_new_tokens, set(stops)
    first = target.forward(ids)
    ids.append(first.argmax[-1])
    drafter.start(first.features, ids)
    run = DecodeRun([])
    t0 = clock()
    while len(ids) < end and ids[-1] not in stop:
        p = len(ids) - 1
        a = clock()
        proposal = drafter.propose(ids)
        b = clock()
        chain = proposal.parents == tuple(range(-1, len(proposal.tokens) - 1))
        verified = target.forward(proposal.tokens, None if chain else proposal.depths,
                                  None if chain else proposal.parents)
        c = clock()
        path = walk(proposal, verified.argmax)
        last = path[-1] if path else 0
        kept = _cut([proposal.tokens[i] for i in path] + [verified.argmax[last]], p + 1, end, stop)
        if chain:
            target.keep(p + 1 + len(path))
        else:
            target.keep(p + 1, [p + i for i in path])
        ids += kept
        d = clock()
        drafter.commit(verified.features[[0, *path]])
        e = clock()
        run.accepted.append(len(kept))
        run.draft_seconds += (b - a) + (e - d)
        run.verify_seconds += c - b
    run.seconds = clock() - t0
    run.tokens = ids[len(prompt):]
    return run


def loop_drafter(drafter: Any, lm_head: torch.Tensor, embed: torch.Tensor, block_size: int | None = None,
                 tree_budget: int = 0, mem_bytes: int = 256 << 20) -> LoopDrafter:
    """``drafter`` in a serving loop, drafting blocks of ``block_size`` (a chain: ``block_size - 1`` steps; None:
    the drafter's own), or with ``tree_budget`` the DDTree of that many nodes: its family's runner and proposer,
    with the target's head ``lm_head`` [V, H] and input embedding ``embed``."""
    from ..drafters.registry import family_named, spec_of
    from ..drafters.runners import as_runner

    runner = as_runner(drafter)
    spec = spec_of(drafter) if not hasattr(runner, "spec") else runner.spec
    family = family_named(spec.family)
    block = int(block_size or spec.block_size)
    if block < 2 or block > family.block_cap(spec):
        raise DecodeError(f"block size {block}: a {family.label} drafter drafts blocks of 2 to "
                          f"{family.block_cap(spec)} tokens here")
    proposer = family.proposer(spec, getattr(runner, "module", None), lm_head, mem_bytes, embed)
    if family.kind == "chain":
        if tree_budget:
            raise DecodeError(f"a {family.label} drafter drafts a chain: it has no DDTree to check")
        return ChainDrafter(runner, proposer, embed, block - 1)
    return BlockDrafter(runner, proposer, embed, block, tree_budget)
