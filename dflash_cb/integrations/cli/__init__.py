"""The command-line tools' code (``tools/*.py`` and the ``dflash-*`` console commands): each module parses its
arguments, checks them before any work, and calls the core; nothing here is imported by another layer."""
