"""The serving projection at the edges: a cost profile read and checked against a cache and a drafter, and a
scored evaluation projected into its results or its live metrics (``core.serving`` does the arithmetic)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...common.arguments import ArgumentError
from ...core.costs.serving import (
    PROJECTION_NOTE,
    TARGET_FIELDS,
    CostProfile,
    ProfileError,
    SampleCycles,
    Setting,
    block_settings,
    identity_mismatches,
    project,
    serving_metrics,
)
from ...core.drafters.registry import family_named, spec_of


def drafter_identity(drafter: Any) -> dict[str, Any]:
    spec = drafter.spec
    return {"family": spec.family, "hidden_size": int(drafter.config.hidden_size),
            "num_layers": int(drafter.config.num_hidden_layers), "block_size": spec.block_size}


def read_profile(path: str | os.PathLike, option: str = "--profile") -> CostProfile:
    """A profile file, or one line naming it (as ``option``) and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ArgumentError(f"{option} {path}: no such file; write one with tools/profile_costs.py") from None
    except (OSError, ValueError) as e:
        raise ArgumentError(f"{option} {path}: cannot be read as JSON ({e}); write it again with "
                            "tools/profile_costs.py") from None
    if isinstance(data, dict) and data.get("partial"):
        raise ArgumentError(f"{option} {path}: an unfinished measurement; run the same tools/profile_costs.py "
                            "command again to finish it")
    try:
        return CostProfile.from_dict(data, f"{option} {path}")
    except ProfileError as e:
        raise ArgumentError(str(e)) from None


def refuse_other_target(profile: CostProfile, target: dict[str, Any], where: str) -> None:
    """A profile measured for another target prices nothing here: refused, naming each field."""
    wrong, _ = identity_mismatches(profile, target, {})
    if wrong:
        raise ArgumentError(f"{where}: measured for another target ({'; '.join(wrong)}); measure this "
                            "cache's target with tools/profile_costs.py --target")
    if not any(profile.target.get(f) is not None for f in TARGET_FIELDS):
        warnings.warn(f"{where}: records no target, so nothing shows it was measured for this cache's; write it "
                      "again with --states CACHE (or --target) to have it checked", stacklevel=2)
    if profile.batch_size != 1:
        warnings.warn(f"{where}: its times are for a batch of {profile.batch_size}; the projection prices one "
                      "sequence's cycles, so its tokens per second are per sequence at that batch", stacklevel=2)


def checked_settings(profile: CostProfile, drafter: Any, block_size: int, budgets: Sequence[int],
                     where: str, smaller: str = "lower --ddtree-budgets", block_option: str = "--block-size",
                     contexts: tuple[int, int] | None = None) -> list[Setting]:
    """The evaluation's settings, each within the profile's rows (else refused, naming the option that scores a
    smaller one: ``block_option`` for the block, ``smaller`` for the budgets or a chain's K); a profile timed with
    another drafter, or whose rows were flagged when measured, or measured only at contexts outside the cache's
    (``contexts``: its shortest prompt and longest sequence), is warned about; a block drafter's pass timed at
    another block than the one scored is refused."""
    identity = drafter_identity(drafter)
    _, other = identity_mismatches(profile, {}, {k: v for k, v in identity.items() if k != "block_size"})
    if other:
        warnings.warn(f"{where}: its drafter pass was timed for another drafter ({'; '.join(other)}): "
                      "the projected draft cost is that drafter's", stacklevel=2)
    spec = spec_of(drafter)
    family = family_named(spec.family)
    tool = block_option.startswith("--")  # a tool's option, else the live evaluator's field (``block_size=``)
    timed = profile.drafter.get("block_size")
    if family.kind == "block" and not other and isinstance(timed, int) and timed != block_size:
        # A block drafter's pass drafts its whole block: a pass of another block costs otherwise.
        use = f"score at {block_option} {timed}" if tool else f"set {block_option}{timed}"
        how = " (tools/profile_costs.py --from-csv ... --draft-seconds S)" if tool else ""
        raise ArgumentError(f"{where}: its drafter pass was timed at block {timed}, this evaluation drafts blocks "
                            f"of {block_size}: {use}, or give a profile whose draft seconds are a "
                            f"block-{block_size} pass{how}")
    settings = family_settings(spec.family, block_size, budgets)
    for s in settings:
        if s.verified > profile.max_verified:
            fix = smaller
            if s.name == "greedy" and family.kind == "block":  # the block sets its tokens, not a budget
                fix = (f"score blocks of up to {profile.max_verified} ({block_option} {profile.max_verified})"
                       if tool else f"set {block_option}{profile.max_verified}")
            raise ArgumentError(f"{where}: {s.label} verifies {s.verified} tokens a cycle, beyond the "
                                f"profile's rows (up to {profile.max_verified}); {profile.reach(s.verified)}, or "
                                f"{fix}")
    if profile.flags:  # rows still unstable after being measured again (a busy machine): priced as they are
        warnings.warn(f"{where}: rows flagged when it was measured ({'; '.join(profile.flags)}): the projection "
                      "prices them as measured; measure again on an idle machine (the same tools/profile_costs.py "
                      "command, another --out)", stacklevel=2)
    measured = sorted(c for c in profile.verify if c > 0)
    if contexts is not None and measured and (contexts[1] < measured[0] or contexts[0] > measured[-1]):
        warnings.warn(f"{where}: its verify rows were measured at contexts {measured[0]} to {measured[-1]} only, "
                      f"the cache's cycles run at contexts {contexts[0]} to {contexts[1]}: every cycle is priced at "
                      f"context {measured[0] if contexts[1] < measured[0] else measured[-1]}; measure at the cache's "
                      f"contexts (tools/profile_costs.py --contexts {contexts[0]},{contexts[1]})", stacklevel=2)
    return settings


def cache_contexts(cache: Any, ids: Sequence[str] | None = None) -> tuple[int, int] | None:
    """The contexts a cache's cycles run at: its shortest prompt to its longest prompt and completion (of ``ids``,
    default every sample); None for an empty selection."""
    wanted = None if ids is None else set(ids)
    entries = [e for e in cache.samples if wanted is None or e.id in wanted]
    if not entries:
        return None
    return min(int(e.prompt_len) for e in entries), max(int(e.total_len) for e in entries)


def add_projection(results: Any, report: Any, cache: Any, profile: CostProfile, settings: list[Setting]) -> None:
    """The projection of a scored evaluation into ``results``: the figures under ``serving/`` beside tau, the
    per-sample accounting and the profile's label in ``breakdown['serving']``."""
    projection = project(sample_cycles(cache, report.samples), settings, profile)
    results.metrics.update(serving_metrics(projection))
    results.breakdown["serving"] = projection.to_dict()
    results.notes["serving"] = f"{PROJECTION_NOTE}: {projection.profile}"


def projected_metrics(profile: CostProfile, cache: Any, samples: Sequence[Any], block_size: int,
                      budgets: Sequence[int], family: str) -> dict[str, float]:
    """A live evaluation's projected figures (``serving/*``) from its scored samples (``family``: the drafter's,
    whose ``draft_passes`` a cycle costs)."""
    return serving_metrics(project(sample_cycles(cache, samples), family_settings(family, block_size, budgets), profile))


def family_settings(family: str, block_size: int, budgets: Sequence[int]) -> list[Setting]:
    """The settings a drafter of ``family`` is served at: its block (a cycle's drafter passes and its label are the
    family's) and each DDTree budget."""
    fam = family_named(family)
    return block_settings(block_size, budgets, fam.draft_passes(block_size), fam.setting_label(block_size), fam.kind)


def sample_cycles(cache: Any, samples: Sequence[Any]) -> list[SampleCycles]:
    """What the projection prices of scored ``samples``: each one's prompt length and every setting's cycles."""
    return [SampleCycles(cache.entry(s.id).prompt_len, {"greedy": s.acceptance_lengths,
                                                        **{f"ddtree_b{b}": v for b, v in s.ddtree.items()}},
                         s.id, s.category) for s in samples]
