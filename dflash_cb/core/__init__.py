"""Layer 2, the evaluation core, in its own layers (lowest first, each importing only those below it):
``loop`` (the greedy loop's arithmetic, DDTree, limits), ``drafters`` (one folder per family, the block and chain
kinds, the registry), ``figures`` (metric names, counts, intervals, breakdowns), ``replay`` (the exact replay of a
drafter on a cache), ``decode`` (real speculative decoding, for the speed check), ``checkpoints`` (reading a
drafter), ``costs`` (what an evaluation and a served setting cost) and ``results`` (results files, reports,
comparisons, plans, sweeps). Plain functions on tensors: no Lightning, W&B or HTTP. Imports ``common`` and
``cache``."""
