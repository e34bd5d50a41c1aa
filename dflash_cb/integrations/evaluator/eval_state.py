"""The evaluation state a training checkpoint carries, and when a resumed run starts a new series.

``EvalState`` is what ``DFlashEvalCallback.state_dict`` saves: the schedule (so a resumed run
neither repeats nor skips an evaluation), the history, and what the history was measured on: the
cache's manifest sha256 and the sample selection (``selection_record``: the evaluated ids' sha256,
their count and the arguments that chose them). A series is comparable only while both stay the
same; ``new_series_reason`` says why a resumed run must start a new one (another cache, another
selection). ``EvalState.from_dict`` reads a saved state field by field and raises
``MalformedStateError`` naming the first bad field: the callback then warns and starts a new
series rather than failing deep inside an evaluation. Pure: no I/O, no Lightning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...common.arguments import is_int
from ...common.errors import DFlashCBError


class MalformedStateError(DFlashCBError, ValueError):
    """A saved evaluation state that cannot be read; the message names the field."""


def selection_record(eval_ids: Sequence[str], num_samples: int | None, sample_ids: Sequence[str] | None,
                     sample_seed: int) -> dict[str, Any]:
    """What identifies a sample selection: the sha256 of the evaluated ids (in order) decides; the
    arguments are kept to say what changed. ``num_samples`` at or above the cache's size selects
    every sample, so it has the same ids (and the same record) as ``num_samples=None``."""
    digest = hashlib.sha256("\n".join(eval_ids).encode()).hexdigest()
    return {"ids_sha256": digest, "count": len(eval_ids), "num_samples": num_samples,
            "sample_ids": len(sample_ids) if sample_ids is not None else None, "sample_seed": sample_seed}


def describe_selection(sel: dict[str, Any]) -> str:
    """``3 samples (num_samples=3, sample_seed=0)``, ``12 samples (every sample)``, ..."""
    if sel.get("sample_ids") is not None:
        how = f"sample_ids: {sel['sample_ids']} ids"
    elif sel.get("num_samples") is not None:
        how = f"num_samples={sel['num_samples']}, sample_seed={sel.get('sample_seed')}"
    else:
        how = "every sample"
    return f"{sel.get('count')} samples ({how})"


def new_series_reason(saved_cache: str | None, saved_selection: dict[str, Any] | None, cache: str,
                      selection: dict[str, Any], cache_path: Any, saved_series: dict[str, Any] | None = None,
                      series: dict[str, Any] | None = None) -> str | None:
    """Why a resumed history cannot go on in this run (None: it can): it was measured on another
    cache, on another sample selection, or with another setting that changes a logged figure (``series``:
    the main keys' ``EvalRequest.series``, i.e. the block, the tail convention, the compute dtype and the
    anchor set; compared on the names both records hold). A state without a record goes on."""
    if saved_cache is not None and saved_cache != cache:
        return (f"measured on another cache (manifest sha256 {saved_cache[:12]}...) than {cache_path} now holds "
                f"({cache[:12]}...)")
    if saved_selection is not None and saved_selection.get("ids_sha256") != selection["ids_sha256"]:
        return (f"measured on another sample selection, {describe_selection(saved_selection)}, than this run's "
                f"{describe_selection(selection)}")
    if saved_series is not None and series is not None:
        changed = [f"{k} {saved_series[k]!r} -> {series[k]!r}" for k in series
                   if k in saved_series and saved_series[k] != series[k]]
        if changed:
            return f"measured with other settings than this run's ({'; '.join(changed)})"
    return None


@dataclass
class EvalState:
    """The callback's persistent state; the defaults are a fresh run's (a new series)."""

    last_eval_step: int = -1
    num_evals: int = 0
    start_done: bool = False
    history: list[dict[str, float]] = field(default_factory=list)  # {"step": s, metric: value, ...}
    last_eval_full: bool = False
    failed_evaluations: int = 0
    cache_manifest_sha256: str | None = None  # the cache the history was measured on
    sample_selection: dict[str, Any] | None = None  # selection_record of the samples it scored
    series: dict[str, Any] | None = None  # what identifies the main keys' figures (EvalRequest.series)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: Any) -> EvalState:
        """Read a saved state, checking every field; ``MalformedStateError`` names the first bad one.

        The first four fields are required (every version saved them); the later ones default to a
        fresh run's values when absent (a checkpoint of an older version). Unknown keys are ignored.
        """
        if not isinstance(state, dict):
            raise MalformedStateError(f"not a dict but a {type(state).__name__}")
        missing = [k for k in ("last_eval_step", "num_evals", "start_done", "history") if k not in state]
        if missing:
            raise MalformedStateError(f"{', '.join(missing)} missing")
        fresh = cls()
        if "series" not in state and "estimator" in state:  # its first name (block and anchor set only)
            state = {**state, "series": state["estimator"]}
        s = cls(**{f.name: state.get(f.name, getattr(fresh, f.name)) for f in dataclasses.fields(cls)})
        _check(s.last_eval_step, "last_eval_step", is_int(s.last_eval_step) and s.last_eval_step >= -1,
               "an integer >= -1")
        for name in ("num_evals", "failed_evaluations"):
            value = getattr(s, name)
            _check(value, name, is_int(value) and value >= 0, "an integer >= 0")
        for name in ("start_done", "last_eval_full"):
            _check(getattr(s, name), name, isinstance(getattr(s, name), bool), "true or false")
        sha = s.cache_manifest_sha256
        _check(sha, "cache_manifest_sha256", sha is None or _is_sha256(sha), "a sha256 hex digest or None")
        ser = s.series
        _check(ser, "series", ser is None or (isinstance(ser, dict) and all(isinstance(k, str) for k in ser)
                                              and all(v is None or is_int(v) or isinstance(v, str)
                                                      for v in ser.values())),
               "None or a dict of setting names to integers or strings")
        sel = s.sample_selection
        _check(sel, "sample_selection", sel is None or (isinstance(sel, dict) and _is_sha256(sel.get("ids_sha256"))
                                                          and is_int(sel.get("count"))),
               "None or a dict with ids_sha256 and count")
        _check(s.history, "history", isinstance(s.history, list), "a list of evaluations")
        for i, h in enumerate(s.history):
            ok = (isinstance(h, dict) and is_int(h.get("step")) and all(isinstance(k, str) for k in h)
                  and all(_is_number(v) for v in h.values()))
            _check(h, f"history[{i}]", ok, "a dict with an integer 'step' and numeric metric values")
        s.history = [dict(h) for h in s.history]
        return s


def _check(value: Any, name: str, ok: bool, expected: str) -> None:
    if not ok:
        shown = repr(value)
        raise MalformedStateError(f"{name} is {shown[:80]}{'...' if len(shown) > 80 else ''}, expected {expected}")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
