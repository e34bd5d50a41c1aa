"""Layer 0, what every other layer uses: the error base class, atomic writes, the one-line CLI error
wrapper and the argument rules. Imports nothing else from ``dflash_cb``."""
