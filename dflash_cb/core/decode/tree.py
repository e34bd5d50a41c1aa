"""The DDTree one cycle verifies, as explicit nodes: best-first over the drafter's top-K per depth under a node
budget (docs/method.md, "DDTree"; the replay counts the same tree's accepted depth without building it,
``loop.ddtree``), and the walk of the target's tokens down it."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    """Node 0 is the root (the verified token); node i > 0 holds ``tokens[i]`` at ``depths[i]`` under
    ``parents[i]``."""

    tokens: tuple[int, ...]
    depths: tuple[int, ...]
    parents: tuple[int, ...]


def build_tree(root: int, top_ids: Sequence[Sequence[int]], top_logprobs: Sequence[Sequence[float]],
               budget: int) -> Tree:
    """Pop ``budget`` nodes best-first: a popped node pushes its next-ranked sibling and its first child. The
    drafter's distribution at a depth does not depend on the tokens above it, so a node's score is its
    parent's plus the log-probability of its rank at its depth; equal scores go to the earlier push."""
    depth_count = len(top_ids)
    k = len(top_ids[0]) if depth_count else 0
    tokens, depths, parents = [root], [0], [-1]
    heap: list[tuple[float, int, int, int, int, float]] = []  # (-score, push, depth, rank, parent, parent score)
    pushes = 0

    def push(score: float, depth: int, rank: int, parent: int, parent_score: float) -> None:
        nonlocal pushes
        heapq.heappush(heap, (-score, pushes, depth, rank, parent, parent_score))
        pushes += 1

    if depth_count and k:
        push(float(top_logprobs[0][0]), 1, 0, 0, 0.0)
    while heap and len(tokens) <= budget:
        neg, _, depth, rank, parent, parent_score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(top_ids[depth - 1][rank]))
        depths.append(depth)
        parents.append(parent)
        if rank + 1 < k:
            push(parent_score + float(top_logprobs[depth - 1][rank + 1]), depth, rank + 1, parent, parent_score)
        if depth < depth_count:
            push(-neg + float(top_logprobs[depth][0]), depth + 1, 0, node, -neg)
    return Tree(tuple(tokens), tuple(depths), tuple(parents))


def walk(tree: Tree, target_next: Sequence[int]) -> list[int]:
    """The accepted path (node indices below the root, in depth order): from the root, the child holding the
    target's token after the current node, while there is one. ``target_next[i]``: the target's argmax after
    node i."""
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(tree.tokens)):
        children[(tree.parents[i], tree.tokens[i])] = i
    path, node = [], 0
    while (node, target_next[node]) in children:
        node = children[(node, target_next[node])]
        path.append(node)
    return path
