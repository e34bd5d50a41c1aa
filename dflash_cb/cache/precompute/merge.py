"""Merge the parts of a ``--num-shards N`` precompute into one cache, equal to a single run's.

The merged cache is built in a staging folder beside ``--out`` (``manifest.merge_staging_path``) and
swapped in by two renames, the previous cache waiting aside for an instant (``replaced_cache_path``);
a rerun finishes what a killed merge left (``_recover``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...common.fileio import atomic_path, check_outputs_apart, naming_failures, output_path
from ..identity import LOCAL_PATHS
from ..manifest import MANIFEST_NAME, CacheError, Manifest, merge_staging_path, replaced_cache_path
from ..states import StateCache
from .errors import PrecomputeError
from .journal import read_journal, write_in_order
from .plan import JOURNAL_NAME, check_only_cache_files, check_out_path, diff, header_dict
from .run import build_manifest

logger = logging.getLogger(__name__)



def _without_part(prompts: dict[str, Any]) -> dict[str, Any]:
    """A part's ``prompts`` header without ``part``: what the merged cache (a single run's) has."""
    return {k: v for k, v in prompts.items() if k != "part"}


def _common(m: Manifest) -> dict[str, Any]:
    d = header_dict(m)
    d["prompts"] = _without_part(d["prompts"])
    d["target_head"] = None if m.target_head is None else m.target_head["sha256"]
    return d


def _place(src: Path, dst: Path, link: bool) -> None:
    """Put ``src`` at ``dst`` atomically: a hard link (no copy of multi-GB shards) or a copy."""
    with atomic_path(dst) as tmp:
        if link:
            tmp.unlink()
            try:
                os.link(src, tmp)
                return
            except OSError:  # another filesystem, or links not supported
                pass
        shutil.copyfile(src, tmp)


def _staged(staging: Path, out: Path, name: str) -> contextlib.AbstractContextManager[None]:
    """A failed write of ``staging/name`` names the file the merge makes, ``out/name``."""
    return naming_failures(out / name, temp=str(staging / name))


def _samples_per_shard_range(m: Manifest) -> tuple[int, float]:
    """The ``--samples-per-shard`` values a part's layout allows: shard ``g`` holds ``index // S == g``."""
    lo, hi = 1, float("inf")
    for s in m.samples:
        g = int(s.shard.split("-")[1].split(".")[0])
        lo = max(lo, s.index // (g + 1) + 1)
        if g > 0:
            hi = min(hi, s.index // g)
    return lo, hi


def _check_samples_per_shard(caches: Sequence[StateCache]) -> None:
    ranges = [_samples_per_shard_range(c.manifest) for c in caches]
    if max(lo for lo, _ in ranges) > min(hi for _, hi in ranges):
        def shown(lo: int, hi: float) -> str:
            return str(lo) if lo == hi else f"{lo}" if hi == float("inf") else f"{lo}..{int(hi)}"
        each = ", ".join(f"{c.path}: {shown(*r)}" for c, r in zip(caches, ranges, strict=True))
        raise PrecomputeError(f"merge: the parts were written with different --samples-per-shard ({each}); "
                              "rerun the parts with one --samples-per-shard value, then merge")


def _recover(out: Path) -> None:
    """Finish what an interrupted merge left beside ``out``: the old cache back in place, no staging."""
    old, staging = replaced_cache_path(out), merge_staging_path(out)
    if old.exists():
        if out.exists():  # the new cache was already in place: the old one is no longer needed
            shutil.rmtree(old)
        else:  # killed between the two renames: put the old cache back
            os.rename(old, out)
            logger.warning(f"merge: restored {out} from an interrupted merge")
    if staging.exists():
        check_only_cache_files(staging, "merge: ")
        shutil.rmtree(staging)


def _stage(caches: Sequence[StateCache], staging: Path, out: Path, link: bool) -> Manifest:
    """Place every part's shards, the head, the journal and the manifest in ``staging``."""
    base = caches[0].manifest
    shards, samples = [], []
    for c in caches:
        for s in c.manifest.shards:
            with _staged(staging, out, s.file):
                _place(c.path / s.file, staging / s.file, link)
            shards.append(s)
        samples.extend(c.manifest.samples)
    head = base.target_head
    if head is not None:
        with _staged(staging, out, head["file"]):
            _place(caches[0].path / head["file"], staging / head["file"], link)
    journals: dict[str, dict[str, Any]] = {}
    for c in caches:
        journals.update(read_journal(c.path / JOURNAL_NAME)[0])
    m = build_manifest(dataclasses.replace(base, prompts=_without_part(base.prompts)), shards, samples, head)
    if journals and all(s.id in journals for s in m.samples):
        with _staged(staging, out, JOURNAL_NAME):
            write_in_order(staging / JOURNAL_NAME, journals, [s.id for s in m.samples])
    with _staged(staging, out, MANIFEST_NAME):
        m.write(staging)
    return m


def _open_parts(parts: Sequence[str | os.PathLike]) -> list[StateCache]:
    caches = []
    for p in parts:
        try:
            caches.append(StateCache(p))
        except CacheError as e:
            raise PrecomputeError(f"merge: {e}") from e
    return caches


def _check_parts(caches: Sequence[StateCache]) -> None:
    """The parts were made with the same arguments and layout, and hold every prompt exactly once."""
    base = caches[0].manifest
    for c in caches[1:]:
        diffs = diff(_common(base), _common(c.manifest))
        for d in [d for d in diffs if d.split(":")[0] in LOCAL_PATHS]:
            logger.warning(f"warning: merge: {c.path} differs in {d} (kept {caches[0].path}'s)")
        diffs = [d for d in diffs if d.split(":")[0] not in LOCAL_PATHS]
        if diffs:
            raise PrecomputeError(f"merge: {c.path} was made with other arguments than {caches[0].path}:\n  - "
                                  + "\n  - ".join(diffs[:20]))
    _check_samples_per_shard(caches)
    count = int(base.prompts.get("count", -1))
    seen: dict[int, str] = {}
    for c in caches:
        for s in c.manifest.samples:
            if s.index in seen:
                raise PrecomputeError(f"merge: prompt #{s.index} ({s.id!r}) is in both {seen[s.index]} and "
                                      f"{c.path}; give each part once")
            seen[s.index] = str(c.path)
    missing = sorted(set(range(count)) - set(seen))
    if missing:
        raise PrecomputeError(f"merge: the parts cover {len(seen)} of {count} prompts; missing prompt indices "
                              f"{missing[:20]} (a part not given or not finished?)")


def _build_staged(caches: Sequence[StateCache], out: Path, link: bool, verify: bool) -> tuple[Path, Manifest]:
    """The merged cache in its staging folder, checked as a reader sees it."""
    staging = merge_staging_path(out)
    staging.mkdir(parents=True)
    try:
        m = _stage(caches, staging, out, link)
    except OSError:  # a full disk: the partial copy would only take more of it
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:  # copies are hashed again (links share the parts' bytes)
        staged = StateCache(staging)
        if verify and not link:
            staged.verify()
        else:
            staged.check_files()
    except CacheError as e:
        raise PrecomputeError(f"merge: the merged cache in {staging} failed its check ({e}); {out} is "
                              "unchanged, rerun the same command") from e
    return staging, m


def _swap_in(staging: Path, out: Path) -> None:
    """Old cache aside, new one in, old one gone; ``_recover`` finishes a kill in between."""
    if out.exists():
        os.rename(out, replaced_cache_path(out))
        os.rename(staging, out)
        shutil.rmtree(replaced_cache_path(out))
    else:
        os.rename(staging, out)


def merge_parts(out: str | os.PathLike, parts: Sequence[str | os.PathLike], overwrite: bool = False,
                link: bool = True, verify: bool = True) -> Manifest:
    """Combine ``--num-shards`` parts into one cache, equal to what a single run would have written.

    The merged cache is built in a staging folder beside ``out`` and checked there; only then does it
    replace ``out`` (two renames). A refused, failed or killed merge leaves ``out`` as it was, and
    running the same command again finishes the job.
    """
    out = output_path(out)  # a symbolic link is written through: the link keeps pointing at the merged cache
    if not parts:
        raise PrecomputeError("merge: give at least one part folder")
    check_out_path(out)
    check_outputs_apart([("part", p) for p in parts], folders=[("--out", out)])
    caches = _open_parts(parts)
    _check_parts(caches)
    _recover(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise PrecomputeError(f"merge: --out {out} is not empty; pass --overwrite to replace it")
        check_only_cache_files(out, "merge: ")
    if verify:  # every part is hashed before anything is written
        for c in caches:
            try:
                c.verify()
            except CacheError as e:
                raise PrecomputeError(f"merge: {e}") from e
    staging, m = _build_staged(caches, out, link, verify)
    _swap_in(staging, out)
    logger.info(f"merged {len(caches)} part(s) into {out}: {len(m.samples)} samples, {len(m.shards)} shards")
    return m
