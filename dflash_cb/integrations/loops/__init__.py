"""The training loops' adapters over the live evaluator: Lightning (``lightning``: ``DFlashEvalCallback``),
Hugging Face's ``Trainer`` (``hf``) and SpecForge's loop (``specforge``, ``specforge_data``). Each finds the
drafter, maps its loop's steps and hooks, and routes the metrics into the loop's own logging."""
