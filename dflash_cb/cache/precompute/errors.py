"""The precompute's error type, apart so that every module of the precompute can raise it."""

from __future__ import annotations

from ...common.errors import DFlashCBError


class PrecomputeError(DFlashCBError, ValueError):
    """Invalid arguments, inputs or output folder; raised before any expensive work."""
