"""Layer 2, the evaluation core: the drafter (``model``), the replay engine (``engine``, ``replay``,
``ddtree``), metric names and figures (``metrics``, ``positions``, ``bootstrap``), results files,
baselines and comparisons, cost and memory models, the training objective and the evaluation tools'
code. Plain functions on tensors: no Lightning, W&B or HTTP. Imports ``common`` and ``cache``."""
