"""The command line of ``tools/speed_check.py``: real greedy speculative decoding on the profile's device, timed
against plain greedy decoding, beside the projection (docs/serving.md, "Checking a projection").

The loops are ``core.decode``; the arithmetic of the figures ``core.costs.measured``; this edge checks the
inputs before any work, interleaves the settings, checks every decode token for token against plain decoding
and cycle for cycle against the replay, and writes the report (and, asked, the profile with the measured
per-cycle overhead).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...common import cli
from ...common.arguments import ArgumentError, parse_int, parse_int_list
from ...common.log import say

USAGE = """Check a projected speedup against real greedy speculative decoding on this machine.

    python tools/speed_check.py --target TARGET_DIR --drafter DRAFTER_DIR --states CACHE --out check.json \\
        [--ddtree-budgets 32] [--block-size N | --speculative-tokens 1,3,5] [--prompts 8] [--repeats 5] \\
        [--profile profile.json [--profile-out profile.checked.json]] [--device cuda] [--dtype bfloat16]

Each setting (the block or chain, each DDTree budget) and plain greedy decoding decode the cache's first
--prompts prompts with K/V caches as a server keeps them, interleaved and repeated after a warm-up. Every
decode must equal plain decoding token for token and the replay cycle for cycle (the first difference is
named; exit code 1). With --profile the projection on the same prompts stands beside the measured speedup;
--profile-out writes that profile again with the per-cycle overhead the loops measured.
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's folder (config.json + safetensors)")
    p.add_argument("--drafter", required=True, help="the drafter's folder")
    p.add_argument("--states", required=True, help="the cache whose prompts are decoded and whose replay is checked")
    p.add_argument("--out", required=True, help="the report to write (JSON)")
    p.add_argument("--block-size", default=None, help="a block drafter's block (default: its own)")
    p.add_argument("--ddtree-budgets", default="", help="DDTree budgets to decode besides the block (e.g. 32)")
    p.add_argument("--speculative-tokens", default=None, metavar="K,K,...",
                   help="a chain drafter's chain lengths (default: its own)")
    p.add_argument("--prompts", default="8", help="how many of the cache's prompts to decode (its first ones)")
    p.add_argument("--repeats", default="5", help="timed decodes of every prompt and setting, after one warm-up")
    p.add_argument("--profile", default=None, help="a cost profile: its projection on the same prompts, beside")
    p.add_argument("--profile-out", default=None,
                   help="write --profile again here with the per-cycle overhead these loops measured")
    p.add_argument("--device", default="cpu", help="where to decode (the profile's device: cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", help="the models' dtype (float32, bfloat16)")
    p.add_argument("--threads", default=None, help="torch threads on a CPU (default: as found)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class _Setting:
    name: str  # the report's key: greedy, ddtree_b32, chain_k3
    label: str
    kind: str  # serving.CYCLE_KINDS
    block: int  # the block (a chain: K + 1) the replay and the loop draft
    budget: int = 0  # a DDTree's nodes
    projected_as: str = "greedy"  # the projection's setting name in the evaluation of ``block``


def _settings(family: Any, spec: Any, args: argparse.Namespace) -> list[_Setting]:
    budgets = parse_int_list("--ddtree-budgets", args.ddtree_budgets, 1) if args.ddtree_budgets.strip() else []
    if family.kind == "chain":
        if args.block_size is not None:
            raise ArgumentError("--block-size is a block drafter's; a chain drafter takes --speculative-tokens K")
        if budgets:
            raise ArgumentError(f"--ddtree-budgets: a {family.label} drafter drafts a chain, with no DDTree")
        cap = family.block_cap(spec) - 1
        ks = (parse_int_list("--speculative-tokens", args.speculative_tokens, 1) if args.speculative_tokens
              else [spec.block_size - 1])
        over = [k for k in ks if k > cap]
        if over:
            raise ArgumentError(f"--speculative-tokens {args.speculative_tokens}: {over} above {cap}, the longest "
                                f"chain a {family.label} drafter is scored at")
        return [_Setting(f"chain_k{k}", family.setting_label(k + 1), "chain", k + 1) for k in sorted(set(ks))]
    if args.speculative_tokens is not None:
        raise ArgumentError("--speculative-tokens is a chain drafter's; a block drafter takes --block-size N")
    block = parse_int("--block-size", args.block_size, 2) if args.block_size is not None else spec.block_size
    if block > family.block_cap(spec):
        raise ArgumentError(f"--block-size {block}: above the drafter's block ({family.block_cap(spec)})")
    if budgets and not family.supports_tree:
        raise ArgumentError(f"--ddtree-budgets: a {family.label} drafter has no DDTree (leave the option out)")
    out = [_Setting("greedy", family.setting_label(block), "block", block)]
    return out + [_Setting(f"ddtree_b{b}", f"DDTree {b}", "ddtree", block, b, f"ddtree_b{b}") for b in budgets]


def _checked_outputs(args: argparse.Namespace) -> Path:
    """The outputs and cheap options checked before anything is loaded or decoded: a run that cannot finish
    fails here. Returns the results path."""
    from ...cache.target import DTYPES
    from ...common.fileio import check_outputs_apart
    from ...core.results.results_file import check_results_path

    check_outputs_apart([("--states", args.states), ("--drafter", args.drafter), ("--target", args.target),
                         ("--profile", args.profile)], files=[("--out", args.out), ("--profile-out", args.profile_out)])
    out = check_results_path(args.out, "--out", "check.json")
    if args.profile_out is not None:
        if args.profile is None:
            raise ArgumentError("--profile-out writes --profile again with the measured overhead: give --profile")
        if Path(args.profile_out).exists():
            raise ArgumentError(f"--profile-out {args.profile_out} exists: give a new path (a profile is never "
                                "overwritten)")
        check_results_path(args.profile_out, "--profile-out", "profile.json")
    if args.dtype not in DTYPES:
        raise ArgumentError(f"--dtype {args.dtype}: one of {', '.join(DTYPES)}")
    return out


def _check_target(args: argparse.Namespace, cache: Any) -> None:
    """``--target`` is the model the cache's states came from (its config only: nothing is loaded)."""
    from ...cache.target import read_target_config
    from ...core.costs.serving import TARGET_FIELDS
    from .profile_costs import target_identity

    have, want = target_identity(read_target_config(args.target)), cache.manifest.target
    wrong = [f"{k}: --target {have[k]}, cache {want.get(k)}" for k in TARGET_FIELDS
             if want.get(k) is not None and have[k] != want.get(k)]
    if wrong:
        raise ArgumentError(f"--target {args.target}: not the target of --states {args.states} ({'; '.join(wrong)})")


@dataclass
class _Replayed:
    """The replay's cycles on the decoded prompts, per setting, and what the profile projects for them."""

    cycles: dict[str, dict[str, list[int]]]  # setting -> prompt -> committed per cycle
    projected: dict[str, Any]  # setting -> projected speedup interval
    priced: dict[str, dict[str, float]]  # setting -> what the profile prices a cycle's parts at


def _replay(cache: Any, drafter: Any, spec: Any, settings: list[_Setting], ids: list[str],
            profile: Any) -> _Replayed:
    """The replay on the same prompts (it refuses a drafter the cache does not fit, before the target loads)."""
    from ...core.costs.serving import priced_per_cycle, project
    from ...core.replay import evaluate
    from ..evaluator.projection import family_settings, sample_cycles

    out = _Replayed({}, {}, {})
    for block in sorted({s.block for s in settings}):
        mine = [s for s in settings if s.block == block]
        budgets = tuple(s.budget for s in mine if s.budget)
        report = evaluate(cache, drafter, sample_ids=ids, budgets=budgets, tail_blocks="served", block_size=block)
        for s in mine:
            out.cycles[s.name] = {r.id: list(r.ddtree[s.budget] if s.budget else r.acceptance_lengths)
                                  for r in report.samples}
        if profile is not None:
            cycles = sample_cycles(cache, report.samples)
            proj = project(cycles, family_settings(spec.family, block, budgets), profile)
            for s in mine:
                at = next(x for x in proj.settings if x.setting.name == s.projected_as)
                out.projected[s.name] = at.speedup
                out.priced[s.name] = priced_per_cycle(cycles, at.setting, profile)
    return out


class _Decodes:
    """Real decodes of the cache's prompts, each checked token for token against plain greedy decoding and cycle
    for cycle against the replay; the first difference is kept (``problems``)."""

    def __init__(self, target: Any, drafters: dict[str, Any], prompts: dict[str, list[int]], layers: list[int],
                 max_new: int, stops: list[int], clock: Any, replay: dict[str, dict[str, list[int]]]):
        self.target, self.drafters, self.prompts, self.layers = target, drafters, prompts, layers
        self.max_new, self.stops, self.clock, self.replay = max_new, stops, clock, replay
        self.reference: dict[str, list[int]] = {}
        self.problems: list[str] = []

    def decode(self, name: str, prompt_id: str) -> tuple[Any, Any]:
        from ...core.costs import measured
        from ...core.decode.loops import plain_decode, speculative_decode
        from ...core.decode.target_steps import TargetSteps

        steps = TargetSteps(self.target.model, self.layers)
        if name == "plain":
            run = plain_decode(steps, self.prompts[prompt_id], self.max_new, self.stops, self.clock)
        else:
            run = speculative_decode(steps, self.drafters[name], self.prompts[prompt_id], self.max_new, self.stops,
                                     self.clock)
        self.checked(name, prompt_id, run)
        return measured.Timed(run.seconds, run.verify_seconds, run.draft_seconds, len(run.accepted),
                              len(run.tokens) - 1), run

    def checked(self, name: str, prompt_id: str, run: Any) -> None:
        ref = self.reference.setdefault(prompt_id, run.tokens) if name == "plain" else self.reference[prompt_id]
        if self.problems:
            return
        if run.tokens != ref:
            at = next((j for j, (a, b) in enumerate(zip(run.tokens, ref, strict=False)) if a != b),
                      min(len(run.tokens), len(ref)))
            self.problems.append(f"{name} on prompt {prompt_id}: token {at} of the completion differs from plain "
                                 f"greedy decoding ({run.tokens[at:at + 1]} vs {ref[at:at + 1]})")
        elif name != "plain" and run.accepted != self.replay[name][prompt_id]:
            want = self.replay[name][prompt_id]
            cyc = next((j for j, (a, b) in enumerate(zip(run.accepted, want, strict=False)) if a != b),
                       min(len(run.accepted), len(want)))
            self.problems.append(f"{name} on prompt {prompt_id}: cycle {cyc} committed "
                                 f"{run.accepted[cyc] if cyc < len(run.accepted) else 'nothing'}, the replay "
                                 f"{want[cyc] if cyc < len(want) else 'nothing'} (the cache's prefill and these "
                                 "passes disagree there: docs/serving.md, \"Checking a projection\")")


def _timed_rounds(decodes: _Decodes, names: list[str], ids: list[str], repeats: int, runs: dict[str, Any],
                  no_progress: bool) -> None:
    """Untimed: plain decoding of every prompt (the tokens every decode must equal), then every setting once on
    the first prompt (the warm-up). Then ``repeats`` timed rounds, each prompt's settings in a rotated order."""
    from tqdm import tqdm

    for pid in ids:
        decodes.decode("plain", pid)
    for name in names[1:]:
        decodes.decode(name, ids[0])
    bar = tqdm(total=repeats * len(ids) * len(names), desc="speed check", unit="decode", disable=no_progress,
               file=sys.stderr)
    for r in range(repeats):
        for i, pid in enumerate(ids):
            shift = (r + i) % len(names)  # every setting in every slot of the rotation, across prompts
            for name in names[shift:] + names[:shift]:
                runs[name].runs[i].append(decodes.decode(name, pid)[0])
                bar.update()
    bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch

    from ...cache.states import StateCache
    from ...cache.target import DTYPES, check_device, load_target
    from ...common.fileio import atomic_write_json
    from ...common.threads import parse_threads, set_threads
    from ...core.checkpoints.load import load_drafter
    from ...core.costs import measured
    from ...core.decode.loops import Clock, loop_drafter
    from ...core.decode.target_steps import check_croppable
    from ...core.drafters.registry import family_named, spec_of
    from ..evaluator.projection import drafter_identity, read_profile, refuse_other_target

    # Cheap checks first: nothing is loaded or decoded for a run that cannot finish.
    out = _checked_outputs(args)
    n_prompts, repeats = parse_int("--prompts", args.prompts, 1), parse_int("--repeats", args.repeats, 1)
    device = check_device(args.device)
    threads = set_threads(parse_threads(args.threads)) if args.threads is not None else torch.get_num_threads()
    cache = StateCache(args.states)
    _check_target(args, cache)
    drafter = load_drafter(args.drafter, device="cpu")
    spec = spec_of(drafter)
    settings = _settings(family_named(spec.family), spec, args)  # the family named in the drafter's config
    profile = stated = None
    if args.profile:
        stated = read_profile(args.profile)  # as written: --profile-out writes it again, with the overhead
        refuse_other_target(stated, cache.manifest.target, f"--profile {args.profile}")
        profile = stated.for_drafter(drafter_identity(drafter))
    ids = [e.id for e in cache.samples][:n_prompts]
    if len(ids) < n_prompts:
        say(f"--prompts {n_prompts}: the cache holds {len(ids)}; decoding them all")
    replayed = _replay(cache, drafter, spec, settings, ids, profile)

    target = load_target(args.target, args.dtype, device=device)
    check_croppable(target.model)
    drafter = drafter.to(device=device, dtype=DTYPES[args.dtype]).eval()
    head, embed = target.lm_head.weight, target.embed_tokens.weight
    prompts = {i: cache.load(i).input_ids[: cache.entry(i).prompt_len].tolist() for i in ids}
    decodes = _Decodes(target, {s.name: loop_drafter(drafter, head, embed, s.block, s.budget) for s in settings},
                       prompts, spec.target_layer_ids, cache.manifest.max_new_tokens, cache.manifest.stop_token_ids,
                       Clock(device), replayed.cycles)
    plain = measured.SettingRuns("plain", "plain decoding", "plain", [[] for _ in ids])
    runs = {"plain": plain, **{s.name: measured.SettingRuns(s.name, s.label, s.kind, [[] for _ in ids])
                               for s in settings}}
    with torch.inference_mode():
        _timed_rounds(decodes, list(runs), ids, repeats, runs, args.no_progress)
    problems = decodes.problems
    results = measured.measure(plain, [runs[s.name] for s in settings], replayed.projected)
    terms = measured.overhead_terms(results)
    verdict = measured.verdict(results, runs, plain)
    command = "python tools/speed_check.py " + " ".join(shlex.quote(a) for a in argv)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu ({platform.processor() or platform.machine()}, {threads} threads)")
    report = {"format": measured.SPEED_CHECK_FORMAT, "version": measured.SPEED_CHECK_VERSION, "command": command,
              "date": datetime.date.today().isoformat(), "device": where, "dtype": args.dtype,
              "torch": torch.__version__, "prompts": ids, "repeats": repeats,
              "exact": not problems, "first_difference": problems[0] if problems else None,
              "plain_seconds_per_token": results[0].plain_step if results else None,
              "settings": [{**r.to_dict(), "priced_per_cycle_seconds": replayed.priced.get(r.name)} for r in results],
              "overhead_seconds_per_cycle": terms,
              "verdict": verdict, "profile": profile.label() if profile is not None else None}
    atomic_write_json(out, report)
    print(format_report(report))
    if args.profile_out is not None and stated is not None:
        from ...core.costs.serving import CostProfile

        checked_profile = dataclasses.replace(stated, overhead=dict(terms),
                                              source=stated.source or f"speed check: {command}")
        atomic_write_json(args.profile_out, CostProfile.to_dict(checked_profile))
        say(f"wrote {args.profile_out}: {checked_profile.label()}")
    if problems:
        say(f"NOT EXACT: {problems[0]}")
        return 1
    return 0


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: measured speedup with its interval and repeat range, the projection beside it and
    their ratio, and the per-cycle split."""
    lines = [f"  MEASURED speed ({report['device']}, {report['dtype']}, {len(report['prompts'])} prompts x "
             f"{report['repeats']} repeats; plain decoding {1e3 * (report['plain_seconds_per_token'] or 0):.2f} "
             "ms/token):"]
    head = (f"    {'setting':<14}{'tau':>7}{'measured':>26}{'repeats':>16}{'projected':>26}{'proj/meas':>10}"
            f"{'verify':>9}{'draft':>8}{'other':>8}  ms/cycle")
    lines.append(head)
    for s in report["settings"]:
        v, lo, hi = s["speedup"]
        proj = s["projected"]
        pc = s["per_cycle_seconds"]
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}"
        lines.append(f"    {s['label']:<14}{s['tau']:>7.3f}{f'{v:.2f}x [{lo:.2f}, {hi:.2f}]':>26}"
                     f"{'[{:.2f}, {:.2f}]'.format(*s['repeat_range']):>16}"
                     f"{(f'{proj[0]:.2f}x [{proj[1]:.2f}, {proj[2]:.2f}]' if proj else '-'):>26}"
                     f"{ratio:>10}"
                     + "".join(f"{1e3 * pc.get(k, 0):>{w}.2f}" for k, w in (("verify", 9), ("draft", 8),
                                                                            ("overhead", 8))))
    priced = [s for s in report["settings"] if s.get("priced_per_cycle_seconds")]
    if priced:
        lines.append("    the profile prices a cycle at (ms, verify / draft / other): " + "; ".join(
            f"{s['label']} " + " / ".join(f"{1e3 * s['priced_per_cycle_seconds'][k]:.2f}"
                                          for k in ("verify", "draft", "overhead")) for s in priced))
    lines.append(f"  {report['verdict']}")
    lines.append("  exact: every decode equals plain greedy decoding and the replay's cycles" if report["exact"]
                 else f"  NOT EXACT: {report['first_difference']}")
    if report["profile"]:
        lines.append(f"  projection: {report['profile']}")
    return "\n".join(lines)


command = cli.command(main)  # the ``dflash-speed-check`` console command
