"""Real greedy speculative decoding, as a server runs it: the target and the drafter step with their caches, cycle
after cycle, and every call is timed. The speed check (``integrations/cli/speed_check.py``) runs these loops
against plain greedy decoding to test a projection; the replay never does (docs/method.md, "The speed check").

``target_steps``: the target with its K/V cache (prefill, verify a block or a tree, keep what was accepted);
``tree``: the DDTree a cycle verifies, built from the drafter's top-K per depth; ``loops``: plain decoding, the
block loop, the DDTree loop and the chain loop, each returning the tokens, the accepted lengths and its times.
"""
