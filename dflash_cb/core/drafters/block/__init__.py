"""The block kind's shared parts (as ``chain.py`` holds the chain kind's): the backbone module every block family
builds on (``drafter.BlockDrafter``), its attention (``attention``), the runners that drive it (``runner``) and the
family bases (``kind``). No family's folder imports a sibling's: each imports from here."""
