"""tools/build_prompts.py (``dflash-build-prompts``): the authors' benchmark prompt sets as a prompt file.

    build_prompts.py --preset dflash-paper --tokenizer <target folder> --out prompts/dflash-paper.jsonl
    build_prompts.py --preset dflash-paper --save-data DIR     # on a machine with the hub: keep the sets
    build_prompts.py --preset dflash-paper --data-dir DIR --tokenizer <target> --out FILE.jsonl   # without it

Parsing and the exit code only; what is built is ``prompt_sets``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

from ..common import cli
from ..common.arguments import parse_str_list
from ..common.fileio import atomic_write_text, check_outputs_apart
from .prompt_sets import PRESETS, PromptSetError, build_records, preset, save_set
from .prompts import missing_tokenizer_files

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="build_prompts.py",
        description="Write the DFlash authors' benchmark prompts (their datasets, templates and subsample) as a "
                    "prompt file for precompute_states.py --prompts (docs/precompute.md).")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS),
                   help="dflash-paper: z-lab/dflash 98bde5f, the published table's ten sets; dflash-0.1: the "
                        "dflash 0.1.0 package's five sets")
    p.add_argument("--out", help="the prompt file to write (JSONL)")
    p.add_argument("--tokenizer", help="the target's tokenizer folder: the prompts are its token ids, and a "
                                       "precompute with another target's tokenizer refuses them")
    p.add_argument("--max-samples", type=int,
                   help="rows per set, as the authors' --max-samples (default: the preset's own counts)")
    p.add_argument("--sets", help="comma-separated categories to build (default: all of the preset's)")
    p.add_argument("--data-dir", help="read the sets saved here by --save-data instead of the hub")
    p.add_argument("--save-data", metavar="DIR",
                   help="only save the preset's sets from the hub into DIR (for --data-dir on another machine)")
    return p


def _build(argv: Sequence[str] | None) -> int:
    ns = build_parser().parse_args(argv)
    p = preset(ns.preset)
    sets = parse_str_list("--sets", ns.sets) if ns.sets else None
    if sets and len(set(sets)) != len(sets):  # a set twice would be built twice: every prompt in it duplicated
        twice = sorted({c for c in sets if sets.count(c) > 1})
        raise PromptSetError(f"--sets {ns.sets}: {', '.join(twice)} given more than once; name each set once")
    chosen = [p.set(c) for c in sets] if sets else list(p.sets)
    if ns.save_data:
        for s in chosen:
            logger.info(f"{s.category}: saved {s.dataset} into {save_set(s, ns.save_data)}")
        return 0
    if not ns.out or not ns.tokenizer:
        raise PromptSetError("--out and --tokenizer are needed to build a prompt file (or --save-data DIR alone)")
    if ns.max_samples is not None and ns.max_samples < 1:
        raise PromptSetError(f"--max-samples {ns.max_samples}: give a positive number of rows per set")
    missing = missing_tokenizer_files(ns.tokenizer)
    if missing:
        raise PromptSetError(f"--tokenizer {ns.tokenizer}: no tokenizer files ({missing}); give the target's folder")
    check_outputs_apart([("--tokenizer", ns.tokenizer), ("--data-dir", ns.data_dir)], [("--out", ns.out)])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer, trust_remote_code=False)
    records = build_records(p, tokenizer, data_dir=ns.data_dir, max_samples=ns.max_samples, categories=sets)
    atomic_write_text(ns.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    counts: dict[str, int] = {}
    for r in records:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    logger.info(f"{ns.out}: {len(records)} prompts of {p.name} ({', '.join(f'{c} {n}' for c, n in counts.items())})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """tools/build_prompts.py: 0 on success, 2 on a user error (one ``error:`` line on stderr)."""
    return cli.run(_build, argv)


command = cli.command(_build)  # ``dflash-build-prompts``
