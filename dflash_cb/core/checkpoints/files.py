"""A training run's checkpoints on disk: what a path names, each checkpoint's step by its name, its identity,
and whether it is complete yet (for a sweep that scores checkpoints while the run writes them).

What counts as a checkpoint (``find_checkpoints``):

- a file ending in ``.ckpt``, ``.pt``, ``.pth``, ``.bin`` or ``.safetensors`` (Lightning's ``.ckpt``, a plain
  loop's ``torch.save``, a bare state dict), outside the folders below;
- a folder holding model weights (``model*.safetensors``, ``pytorch_model.bin``): a Hugging Face ``Trainer``'s
  ``checkpoint-N/`` or a saved drafter folder; a folder that also holds checkpoint folders is a run's output
  folder (its own files are the final ``save_model`` copy and the loop's state): it is searched, not scored;
- a folder holding SpecForge's ``training_state.pt`` (its ``<run>-stepN/``).

A folder given is searched through (hidden folders, symbolic links, caches of target states and the folders
in ``skip`` left out);
Lightning's ``last.ckpt`` (``save_last``: a copy of the newest checkpoint) is left out of a search but scored
when named. A checkpoint's identity is the ``integrity.file_identity`` of every file it is made of: a file
rewritten, replaced or copied is another checkpoint.
"""

from __future__ import annotations

import enum
import glob
import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...cache.integrity import file_identity
from ...cache.manifest import MANIFEST_NAME
from ...common.errors import DFlashCBError
from .load import SPECFORGE_STATE

CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")
_LAST_ALIAS = re.compile(r"last(-v\d+)?\.ckpt")
# The step a name carries: ``checkpoint-500`` (Hugging Face), ``epoch=0-step=500`` (Lightning), ``run-step500``
# (SpecForge), ``step_500``, ``global_step500``, ``iter_500``, or a bare ``500``; the last one in the name.
_NAME_STEPS = (re.compile(r"^checkpoint[-_](\d+)$", re.I),
               re.compile(r"(?:^|[^a-z0-9])(?:global_?)?(?:step|iter|iteration)[=_-]?(\d+)", re.I),
               re.compile(r"^(\d+)$"))
# A Hugging Face Trainer writes trainer_state.json after the weights, optimizer and RNG state.
_HF_STATE = "trainer_state.json"
_HF_COMPANIONS = ("optimizer.pt", "scheduler.pt", "training_args.bin")


class CheckpointPathError(DFlashCBError, ValueError):
    """A path given to the sweep that names no checkpoint."""


class CheckpointKind(str, enum.Enum):
    """How a checkpoint is stored (the reader is ``checkpoints.load_checkpoint`` for each)."""

    FILE = "file"  # a .ckpt / .pt / .pth / .bin / .safetensors file
    WEIGHTS_FOLDER = "weights folder"  # Hugging Face checkpoint-N, a saved drafter folder
    SPECFORGE = "specforge"  # <run>-stepN/ with training_state.pt


def step_from_name(path: str | os.PathLike) -> int | None:
    """The training step a checkpoint's name carries (its suffix left out), None when it carries none."""
    name = Path(path).name
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in CHECKPOINT_SUFFIXES else name
    for rx in _NAME_STEPS:
        found = rx.findall(stem)
        if found:
            step = int(found[-1])
            return step if step <= 2**63 - 1 else None  # beyond int64: no step a series can plot
    return None


def folder_kind(folder: Path) -> CheckpointKind | None:
    """The kind of checkpoint ``folder`` is, None when it is none."""
    if (folder / SPECFORGE_STATE).is_file():
        return CheckpointKind.SPECFORGE
    if any(folder.glob("model*.safetensors")) or (folder / "pytorch_model.bin").is_file():
        return CheckpointKind.WEIGHTS_FOLDER
    return None


@dataclass(frozen=True)
class FoundCheckpoint:
    """One checkpoint on disk."""

    path: Path  # absolute, as found (not through links)
    kind: CheckpointKind

    @property
    def name_step(self) -> int | None:
        return step_from_name(self.path)

    def files(self) -> list[Path]:
        """The files it is made of: itself, or every file under the folder (sorted)."""
        if self.kind is CheckpointKind.FILE:
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())

    def identity(self) -> list[list[str | int]]:
        """``[relative name, *file_identity]`` per file: changes when any of its files is written again."""
        out: list[list[str | int]] = []
        for f in self.files():
            try:
                st = f.stat()
            except FileNotFoundError:  # removed while listed: the next look sees the new content
                continue
            out.append([str(f.relative_to(self.path)) if f != self.path else f.name, *file_identity(st)])
        return out

    def newest_mtime(self) -> float:
        times = [f.stat().st_mtime for f in self.files() if f.exists()]
        return max(times, default=0.0)

    def incomplete(self) -> str | None:
        """Why this checkpoint is not completely written yet (a watcher waits for it), or None.

        A zip-format file (``torch.save``, Lightning) is complete once its central directory is written (it
        comes last); a Hugging Face ``Trainer`` folder once ``trainer_state.json`` is (written after the
        weights); a folder with a ``*.tmp`` file inside is being written (SpecForge writes ``.tmp`` files and
        renames them)."""
        if self.kind is CheckpointKind.FILE:
            try:
                size = self.path.stat().st_size
                with open(self.path, "rb") as f:
                    head = f.read(4)
            except OSError as e:
                return f"cannot be read yet ({e.strerror})"
            if size == 0:
                return "empty"
            if head.startswith(b"PK\x03\x04") and not zipfile.is_zipfile(self.path):
                return "its zip archive has no central directory yet"
            return None
        if any(p.name.endswith(".tmp") for p in self.files()):
            return "a .tmp file inside is being written"
        if self.kind is CheckpointKind.WEIGHTS_FOLDER and not (self.path / _HF_STATE).is_file() \
                and any((self.path / c).exists() for c in _HF_COMPANIONS):
            return f"a Hugging Face Trainer checkpoint without {_HF_STATE} yet"
        return None


def _real(path: Path) -> str:
    return os.path.realpath(path)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _holds_checkpoint_folders(folder: Path) -> bool:
    return any(c.is_dir() and not c.is_symlink() and folder_kind(c) is not None for c in folder.iterdir())


def _search(root: Path, skip: list[str], found: list[FoundCheckpoint]) -> None:
    """The checkpoints under folder ``root`` (not itself)."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            sub = here / d
            if (d.startswith(".") or sub.is_symlink() or any(_inside(_real(sub), s) for s in skip)
                    or (sub / MANIFEST_NAME).is_file()):  # a cache of target states
                continue
            kind = folder_kind(sub)
            if kind is not None and not _holds_checkpoint_folders(sub):
                found.append(FoundCheckpoint(sub, kind))
            else:
                keep.append(d)
        dirnames[:] = keep
        if folder_kind(here) is not None:
            continue  # a run's output folder: its own files are the final model and the loop's state
        for name in sorted(filenames):
            f = here / name
            if (name.startswith(".") or f.suffix not in CHECKPOINT_SUFFIXES or _LAST_ALIAS.fullmatch(name)
                    or f.is_symlink()):
                continue
            found.append(FoundCheckpoint(f, CheckpointKind.FILE))


def _one(path: Path, skip: list[str], found: list[FoundCheckpoint]) -> None:
    path = Path(os.path.abspath(path))
    if path.is_file():
        if path.suffix not in CHECKPOINT_SUFFIXES:
            raise CheckpointPathError(f"{path}: not a checkpoint file (expected one of "
                                      f"{', '.join(CHECKPOINT_SUFFIXES)}, or a folder to search)")
        found.append(FoundCheckpoint(path, CheckpointKind.FILE))
        return
    kind = folder_kind(path)
    if kind is not None and not _holds_checkpoint_folders(path):
        found.append(FoundCheckpoint(path, kind))
    else:
        _search(path, skip, found)


def find_checkpoints(paths: Sequence[str], skip: Sequence[str | os.PathLike] = (),
                     require: bool = True) -> list[FoundCheckpoint]:
    """Every checkpoint the ``paths`` name (files, folders, or glob patterns, ``**`` included), each once, in the
    order of the steps their names carry (then by path). ``skip``: folders never searched (the sweep's output,
    the cache). ``require``: a path that does not exist, a pattern that matches nothing and a search that finds
    nothing are errors naming the path (a watcher passes False: the run may not have written anything yet;
    a path that does not exist is an error anyway unless it is a pattern)."""
    skipped = [_real(Path(s)) for s in skip]
    found: list[FoundCheckpoint] = []
    for given in paths:
        if glob.has_magic(given):
            matches = sorted(glob.glob(given, recursive=True))
            if not matches and require:
                raise CheckpointPathError(f"{given}: the pattern matches nothing; check it (quote it so that the "
                                          "shell does not expand it first)")
        elif not os.path.lexists(given):
            raise CheckpointPathError(f"{given}: no such file or folder; pass checkpoint files, folders holding "
                                      "them, or glob patterns")
        else:
            matches = [given]
        before = len(found)
        for m in matches:
            _one(Path(m), skipped, found)
        if require and len(found) == before:
            raise CheckpointPathError(
                f"{given}: no checkpoint under it (looked for {', '.join('*' + s for s in CHECKPOINT_SUFFIXES)} "
                f"files, Hugging Face checkpoint-N/ and saved drafter folders, SpecForge <run>-stepN/ folders)")
    unique: dict[str, FoundCheckpoint] = {}
    for c in found:
        unique.setdefault(_real(c.path), c)
    return sorted(unique.values(), key=lambda c: (c.name_step is None, c.name_step or 0, str(c.path)))


def same_name_steps(found: Sequence[FoundCheckpoint]) -> list[tuple[FoundCheckpoint, FoundCheckpoint]]:
    """Pairs of checkpoints whose names carry the same step (two points at one step of a curve)."""
    seen: dict[int, FoundCheckpoint] = {}
    pairs = []
    for c in found:
        step = c.name_step
        if step is None:
            continue
        if step in seen:
            pairs.append((seen[step], c))
        else:
            seen[step] = c
    return pairs


def output_inside_checkpoint(out: str | os.PathLike, found: Sequence[FoundCheckpoint]) -> FoundCheckpoint | None:
    """The checkpoint folder ``out`` lies inside, if any (writing there would change the checkpoint)."""
    real = _real(Path(out))
    for c in found:
        if c.kind is not CheckpointKind.FILE and _inside(real, _real(c.path)):
            return c
    return None
