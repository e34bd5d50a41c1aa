"""DFlash 2 (docs/method.md, "DFlash 2"): the block backbone with causal convolutions and a path selector over the
head's top-K; its module (``model``), selector (``selector``), figures, cost terms and training loss."""
