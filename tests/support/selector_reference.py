"""Test oracles for the DFlash 2 selector's tree, plain Python and independent of ``dflash_cb``: the tree
built with ``heapq`` over explicit candidate paths as docs/method.md ("DFlash 2") describes it, and, where
no two scores tie, by enumerating every path and keeping the best ones."""

from __future__ import annotations

import heapq
import itertools


def _row(first, steps, path):
    """Log-probabilities of the children of ``path`` (a tuple of candidate indices from the anchor)."""
    return first if not path else steps[len(path) - 1][path[-1]]


def _walk(tree, ids, target, depth_count):
    """Follow the target's tokens from the anchor while the next one is a child in ``tree``."""
    path = ()
    for d in range(depth_count):
        nxt = [path + (b,) for b in range(len(ids[d])) if ids[d][b] == target[d] and path + (b,) in tree]
        if not nxt:
            return d
        path = nxt[0]
    return depth_count


def heap_tree_accept(ids, first, steps, depth_count, target, budget):
    """Best first with heapq: a pop adds the path and pushes its next-ranked sibling and its best child; ranks
    by log-probability, equal ones in candidate order; equal scores pop in push order."""
    k = len(first)

    def ranked(path):
        row = _row(first, steps, path)
        return sorted(range(k), key=lambda b: (-row[b], b)), row

    counter = 0
    heap = []
    if depth_count > 0:
        order, row = ranked(())
        heap.append((-row[order[0]], counter, (), 0, 0.0))
    tree = set()
    while heap and len(tree) < budget:
        neg, _, parent, rank, parent_score = heapq.heappop(heap)
        order, row = ranked(parent)
        node = parent + (order[rank],)
        tree.add(node)
        if rank + 1 < k:
            counter += 1
            heapq.heappush(heap, (-(parent_score + row[order[rank + 1]]), counter, parent, rank + 1, parent_score))
        if len(node) < depth_count:
            child_order, child_row = ranked(node)
            counter += 1
            heapq.heappush(heap, (-(-neg + child_row[child_order[0]]), counter, node, 0, -neg))
    return _walk(tree, ids, target, depth_count)


def enumerated_tree_accept(ids, first, steps, depth_count, target, budget):
    """The ``budget`` best paths of the whole lattice (exact when no two scores tie: a child scores below its
    parent, so the best paths always form a tree), walked along the target."""
    k = len(first)
    scored = []
    for depth in range(1, depth_count + 1):
        for path in itertools.product(range(k), repeat=depth):
            scored.append((sum(_row(first, steps, path[:i])[path[i]] for i in range(depth)), path))
    scored.sort(key=lambda item: -item[0])
    return _walk({p for _, p in scored[:budget]}, ids, target, depth_count)
