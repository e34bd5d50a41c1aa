"""Layer 1, the cache of target states: its format (``manifest``), reader (``states``), integrity checks
(``integrity``) and sample selection (``selection``), the target and its head, prompt files, the SGLang
client, the server's speculative counters (``served``) and the precompute that writes a cache. Imports
only ``common``."""
