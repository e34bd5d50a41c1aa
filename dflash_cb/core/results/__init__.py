"""Results: results files, reports, baselines, comparisons, plans and sweeps.

This package was once the module ``dflash_cb/core/results.py``, whose names are in ``dflash_cb.core.results.results_file`` now: until the next release they
import from here too, with a ``DeprecationWarning``."""

from ...common.moved import names_from

__getattr__ = names_from(__name__, "dflash_cb.core.results.results_file")
