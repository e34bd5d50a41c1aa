"""The test oracle for DDTree: the tree built with ``heapq`` exactly as docs/method.md describes it, then
walked along the target's tokens; plain Python, independent of ``dflash_cb.core.loop.ddtree``."""

from __future__ import annotations

import heapq


def reference_tree_accept(ids, logp, depth_count, target, budget):
    """Build the tree with heapq as docs/method.md describes, then walk it along the target."""
    k = len(ids[0])
    counter = 0
    heap = []
    if depth_count > 0:
        heap.append((-logp[0][0], counter, 0, 0, "root", 0.0))
    nodes = {}  # node id -> (parent id, token, depth)
    children = {"root": {}}
    popped = 0
    while heap and popped < budget:
        neg, _, d, r, parent, parent_score = heapq.heappop(heap)
        score = -neg
        node = (parent, d, r)
        nodes[node] = score
        children.setdefault(parent, {})[ids[d][r]] = node
        children.setdefault(node, {})
        popped += 1
        if r + 1 < k:
            counter += 1
            heapq.heappush(heap, (-(parent_score + logp[d][r + 1]), counter, d, r + 1, parent, parent_score))
        if d + 1 < depth_count:
            counter += 1
            heapq.heappush(heap, (-(score + logp[d + 1][0]), counter, d + 1, 0, node, score))
    cur, accepted = "root", 0
    for d in range(depth_count):
        nxt = children.get(cur, {}).get(target[d])
        if nxt is None:
            break
        cur, accepted = nxt, accepted + 1
    return accepted
