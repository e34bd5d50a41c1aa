"""The greedy speculative loop's arithmetic, shared by the replay and the decoders: a sample's bounds and the
cycle rules (``cycles``), DDTree (``ddtree``), the anchor-statistics sets (``anchor_sets``), the memory limits and
cost groups (``limits``), and the finite-weights check (``finite``). Pure functions on tensors."""
