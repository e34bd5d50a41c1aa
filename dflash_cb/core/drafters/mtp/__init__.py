"""The target's own multi-token-prediction head (Qwen3.5 / Qwen3.6 ``mtp.*``) as a chain drafter."""
