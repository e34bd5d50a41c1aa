"""Domino: the DFlash backbone with a GRU correction of the block's logits (docs/method.md, "Drafter families")."""
