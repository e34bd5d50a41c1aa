"""checkpoints."""
