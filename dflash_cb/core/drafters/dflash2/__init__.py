"""dflash2."""
