"""Layer 4, the CPU demo: the synthetic language, the demo's Lightning training module and the
end-to-end run behind ``tools/demo.py``. Imports any layer below."""
