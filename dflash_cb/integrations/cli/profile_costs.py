"""The command line of ``tools/profile_costs.py``: a cost profile for the serving projection (``core.serving``).

Three ways to one versioned JSON file:

- measured: the real target and drafter timed on whatever device this runs on (CUDA events on a GPU, the
  monotonic clock on a CPU): the target's forward of n tokens after a context of L committed ones (its K/V
  cache filled by a prefill, copied before every timed step), one drafter pass (blocks and head); written
  after every context, so an interrupted run resumes where it stopped.
- ``--roofline``: no target run; weight and K/V bytes over the memory bandwidth, FLOPs over the peak, both
  stated by the user; a labelled estimate.
- ``--from-csv``: the user's own serving measurements (``verified_tokens,seconds``) and ``--draft-seconds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...common import cli
from ...common.arguments import ArgumentError, parse_int, parse_int_list
from ...common.errors import DFlashCBError
from ...common.log import say
from ...core.costs.serving import MAX_STEP_SECONDS, CostProfile, ProfileError
from ..evaluator.projection import drafter_identity
from .profile_csv import SUSPICIOUS_ONE_TOKEN_SECONDS, from_csv, read_csv_rows  # noqa: F401  (--from-csv)

USAGE = """Measure (or state) the step costs the serving projection prices a replay with.

    python tools/profile_costs.py --target TARGET_DIR --drafter DRAFTER_DIR --out profile.json \\
        [--device cuda] [--dtype bfloat16] [--contexts 512,2048,8192] [--tokens 1-16] [--repeats 5]
    python tools/profile_costs.py --roofline --bandwidth-gbs 4800 --peak-tflops 989 \\
        --target TARGET_DIR [--drafter DRAFTER_DIR] --out profile.json
    python tools/profile_costs.py --from-csv verify.csv --draft-seconds 0.004 [--states CACHE] --out profile.json

Then: python tools/eval_drafter.py ... --profile profile.json (projected tokens per second and speedup).
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the profile to write (JSON; an unfinished one is resumed)")
    p.add_argument("--target", default=None, help="the target's folder (config.json + safetensors)")
    p.add_argument("--drafter", default=None,
                   help="the drafter's folder, or several comma-separated (drafters of several families side by "
                        "side: one profile, each drafter's own pass or step timed against the same target steps)")
    p.add_argument("--states", default=None, help="a cache: the target's identity for --from-csv without --target")
    p.add_argument("--device", default="cpu", help="where to measure (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="bfloat16", help="the weights' dtype when measuring (bfloat16, float32)")
    p.add_argument("--contexts", default="512,2048", help="context lengths to measure at")
    p.add_argument("--tokens", default=None,
                   help="verified token counts: a list (1,2,4,8,16) or a range (1-16); default 1 to the drafter's "
                        "block (and --max-budget + 1)")
    p.add_argument("--max-budget", type=int, default=0, help="also measure up to this DDTree budget + 1 tokens")
    p.add_argument("--repeats", default="5", help="timed runs per point (the median is kept), after one warm-up")
    p.add_argument("--roofline", action="store_true", help="estimate from bytes and FLOPs (no target run)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="--roofline: memory bandwidth, GB/s")
    p.add_argument("--peak-tflops", type=float, default=None, help="--roofline: peak matrix throughput, TFLOP/s")
    p.add_argument("--from-csv", default=None, help="your own verify-step times: columns verified_tokens,seconds")
    p.add_argument("--draft-seconds", default=None,
                   help="--from-csv: one drafter pass (block drafters) or one step (chain drafters), seconds; with "
                        "several --drafter, one value per drafter, comma-separated, in their order")
    p.add_argument("--batch-size", type=int, default=1, help="the batch the times are for (measured: 1)")
    p.add_argument("--overhead", default=None, metavar="KIND=SECONDS,...",
                   help="the seconds a cycle pays outside the two models' calls, per kind of setting (block, ddtree, "
                        "chain), e.g. block=0.0002,ddtree=0.0005: your own measurement (tools/speed_check.py "
                        "--profile-out measures it)")
    return p.parse_args(argv)


def _write(path: Path, data: dict[str, Any]) -> None:
    from ...common.fileio import atomic_write_json

    atomic_write_json(path, data)


def _tokens(args: argparse.Namespace, block: int | None) -> list[int]:
    if args.tokens:
        text = args.tokens.strip()
        if "-" in text and "," not in text:
            lo, hi = (parse_int("--tokens", x, 1) for x in text.split("-", 1))
            if hi < lo:
                raise ArgumentError(f"--tokens {text}: the range's end is below its start")
            return list(range(lo, hi + 1))
        return sorted(set(parse_int_list("--tokens", text, 1)))
    top = max(block or 1, args.max_budget + 1)
    return list(range(1, top + 1))


def target_identity(config: Any) -> dict[str, Any]:
    return {"name": Path(str(config.name_or_path)).name, "hidden_size": config.hidden_size,
            "num_layers": config.num_layers, "vocab_size": config.vocab_size}


# -- --from-csv --------------------------------------------------------------------------------------------

def draft_seconds_list(text: str | None, drafters: int) -> list[float] | None:
    """``--draft-seconds``: one value per drafter (one when no drafter is named), each finite and >= 0."""
    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise ArgumentError(f"--draft-seconds {text}: seconds as numbers, e.g. 0.004 or 0.004,0.001") from None
    if len(values) != max(1, drafters):
        raise ArgumentError(f"--draft-seconds {text}: {len(values)} value(s) for {max(1, drafters)} drafter(s); give "
                            "one per --drafter, in their order")
    for i, v in enumerate(values):
        if not (math.isfinite(v) and 0 <= v <= MAX_STEP_SECONDS):
            which = f"value {i + 1} ({v!r})" if len(values) > 1 else repr(v)
            raise ArgumentError(f"--draft-seconds {text}: {which} is not a drafter pass's time; give seconds "
                                f"between 0 and {MAX_STEP_SECONDS:g}, e.g. 0.004")
    return values


# -- --roofline --------------------------------------------------------------------------------------------

def roofline(target_dir: str, drafters: list[Any], contexts: list[int], tokens: list[int], dtype_bytes: int,
             bandwidth_gbs: float, peak_tflops: float) -> tuple[dict[int, tuple[tuple[int, float], ...]],
                                                                list[dict[int, float]], str]:
    """A step's time as the larger of bytes read over the bandwidth and FLOPs over the peak: the target's
    weights and the K/V of its full-attention layers over the context; 2 FLOPs a parameter a token and the
    attention's 4 * n * context * (heads * head_dim) per full-attention layer."""
    from ...cache.target import count_text_parameters, read_target_config

    cfg = read_target_config(target_dir)
    params = count_text_parameters(target_dir, cfg)
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads") or 1)
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or cfg.hidden_size // heads)
    types = text.get("layer_types") or ["full_attention"] * cfg.num_layers
    full = sum(1 for t in types if t == "full_attention")
    bw, peak = bandwidth_gbs * 1e9, peak_tflops * 1e12

    def step(n: int, ctx: int, p: int, layers: int, kv_heads: int, hd: int, q_heads: int) -> float:
        bytes_read = p * dtype_bytes + layers * 2 * kv_heads * hd * ctx * dtype_bytes
        flops = 2 * p * n + 4 * n * (ctx + n) * q_heads * hd * layers
        return max(bytes_read / bw, flops / peak)

    verify = {c: tuple((n, step(n, c, params, full, kv, head_dim, heads)) for n in tokens) for c in contexts}
    drafts = []
    for drafter in drafters or [None]:
        draft = {c: 0.0 for c in contexts}
        if drafter is not None:
            dp = sum(p.numel() for p in drafter.parameters()) + drafter.config.vocab_size * cfg.hidden_size  # + head
            dc = drafter.config
            q_heads = int(dc.num_attention_heads)
            n = _pass_tokens(drafter)
            draft = {c: step(n, c, dp, int(dc.num_hidden_layers), int(getattr(dc, "num_key_value_heads", q_heads)),
                             int(getattr(dc, "head_dim", None) or dc.hidden_size // q_heads), q_heads)
                     for c in contexts}
        drafts.append(draft)
    stated = f"roofline: {bandwidth_gbs:g} GB/s, {peak_tflops:g} TFLOP/s stated, {dtype_bytes}-byte weights"
    return verify, drafts, stated


# -- measured ----------------------------------------------------------------------------------------------

class StepClock:
    """Seconds of a callable: CUDA events on a GPU (the device's own clock), the monotonic clock on a CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.torch = torch

    def once(self, fn: Callable[[Any], Any], prepare: Callable[[], Any] = lambda: None) -> float:
        """One timed call of ``fn`` on what ``prepare`` (untimed) returns."""
        arg = prepare()
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.monotonic()
        fn(arg)
        return time.monotonic() - t0


Row = tuple[str, int]  # ("verify", tokens) or ("draft", drafter index)


def interleaved(calls: dict[Row, tuple[Callable[[Any], Any], Callable[[], Any]]], clock: StepClock, repeats: int,
                rounds_done: int = 0) -> dict[Row, list[float]]:
    """Every row timed once per round, ``repeats`` rounds (a first, untimed one warms up when nothing was timed
    yet), the rows' order rotated each round: a preemption on a shared core moves one repeat of a few rows, not a
    whole row."""
    rows = list(calls)
    out: dict[Row, list[float]] = {r: [] for r in rows}
    for r in range(repeats + (0 if rounds_done else 1)):
        shift = (r + rounds_done) % len(rows)
        for row in rows[shift:] + rows[:shift]:
            t = clock.once(*calls[row])
            if r or rounds_done:
                out[row].append(t)
    return out


def measure_context(model: Any, drafters: list[Any], head: Any, ctx: int, tokens: list[int], clock: StepClock,
                    repeats: int, device: Any, vocab: int, embed: Any = None
                    ) -> tuple[list[tuple[int, float]], list[float], list[tuple[int, float]], list[str],
                               list[tuple[int, list[float]]]]:
    """(verify rows, each drafter's pass seconds: 0 when none is named, each verify row's spread, flags, each
    verify row's repeats) at one
    context length. The calls are a serving loop's (``core.decode``): a verify pass returns the drafter's
    features and the argmax and is cut back to one accepted token; a block drafter's pass appends a committed
    row to its context, drafts its block and runs the head. Rows are timed interleaved; a row that breaks
    monotonicity or spreads too wide is measured again, then flagged."""
    import torch

    from ...core.costs.serving import row_spread, suspicious_rows
    from ...core.decode.target_steps import TargetSteps

    g = torch.Generator().manual_seed(ctx)
    ids = torch.randint(0, vocab, (ctx + max(tokens),), generator=g).tolist()
    layer_ids = drafters[0].spec.target_layer_ids if drafters else [int(model.config.num_hidden_layers) - 1]
    calls: dict[Row, tuple[Callable[[Any], Any], Callable[[], Any]]] = {}
    with torch.inference_mode():
        # One cache, kept warm as a server's is: each timed pass is cut back to the context after it (a K/V
        # cache returns to what it was; a recurrent layer's state drifts, which changes no pass's cost).
        base = TargetSteps(model, layer_ids, timing_only=True)
        base.forward(ids[:ctx])

        for n in tokens:
            def verify(steps: TargetSteps, n: int = n) -> None:
                steps.forward(ids[ctx:ctx + n])
                steps.keep(ctx)

            calls["verify", n] = (verify, lambda: base)
        for j, d in enumerate(drafters):
            calls["draft", j] = _drafter_call(d, head, embed, ctx, ids, device)
        if drafters:
            # In a loop the two models alternate, each call finding the other's weights in the caches: before a
            # timed verify the first drafter runs (untimed), before a timed drafter pass a 1-token verify does.
            first_pass, first_prepare = calls["draft", 0]
            one_token = calls["verify", min(tokens)][0]

            def after_the_drafter() -> TargetSteps:
                first_pass(first_prepare())
                return base

            def after_a_verify(prepare: Callable[[], Any]) -> Callable[[], Any]:
                return lambda: (one_token(base), prepare())[1]

            for n in tokens:
                calls["verify", n] = (calls["verify", n][0], after_the_drafter)
            for j in range(len(drafters)):
                calls["draft", j] = (calls["draft", j][0], after_a_verify(calls["draft", j][1]))
        samples = interleaved(calls, clock, repeats)
        flags: list[str] = []
        verify_rows = {n: samples["verify", n] for n in tokens}
        again = suspicious_rows(verify_rows)
        if again:  # measured again, all the suspicious rows interleaved, and pooled with the first repeats
            more = interleaved({("verify", n): calls["verify", n] for n in again}, clock, repeats, repeats)
            for n in again:
                verify_rows[n] = verify_rows[n] + more["verify", n]
            flags = [f"context {ctx}: {why}, after measuring again" for why in suspicious_rows(verify_rows).values()]
    rows = [(n, sorted(verify_rows[n])[len(verify_rows[n]) // 2]) for n in tokens]
    drafts = [sorted(samples["draft", j])[len(samples["draft", j]) // 2] for j in range(len(drafters))] or [0.0]
    spread = [(n, row_spread(verify_rows[n])) for n in tokens]
    return rows, drafts, spread, sorted(set(flags)), [(n, list(verify_rows[n])) for n in tokens]


def _drafter_call(drafter: Any, head: Any, embed: Any, ctx: int, ids: list[int], device: Any
                  ) -> tuple[Callable[[Any], Any], Callable[[], Any]]:
    """A drafter's timed call at context ``ctx``: a block drafter's pass as a serving loop makes it (a committed
    row appended to its context, the block, the head: ``decode.loops.BlockDrafter``); a chain drafter's one step
    (``_drafter_pass``)."""
    if _pass_tokens(drafter) == 1 or embed is None:
        return _drafter_pass(drafter, head, ctx, device), lambda: None
    import torch

    from ...core.decode.loops import loop_drafter

    spec = drafter.spec
    g = torch.Generator().manual_seed(0)
    width = len(spec.target_layer_ids) * spec.target_hidden_size
    feats = torch.randn(ctx + 1, width, generator=g).to(device)
    loop = loop_drafter(drafter, head, embed)

    def started() -> Any:
        loop.start(feats[:ctx], ids[:ctx + 1])
        return loop

    def one_pass(state: Any) -> None:
        state.commit(feats[ctx:ctx + 1])
        state.propose(ids[:ctx + 2])

    return one_pass, started


def _pass_tokens(drafter: Any) -> int:
    """Tokens one timed drafter pass drafts: a block drafter's whole block; a chain drafter's one step."""
    from ...core.drafters.registry import family_named

    return 1 if family_named(drafter.spec.family).kind == "chain" else drafter.spec.block_size


def _drafter_pass(drafter: Any, head: Any, ctx: int, device: Any) -> Callable[[Any], Any]:
    """One drafter pass at position ``ctx`` through the replay's own runner (``drafters.runners.as_runner``),
    ready to time: a block drafter's block, or one step of a chain drafter (its first draft comes from the context
    pass, so a step is the second), and the head on its drafts. The runner and the context are built here, once:
    a server builds the context once per committed token, not per pass."""
    import torch

    from ...core.drafters.runners import as_runner

    spec = drafter.spec
    runner = as_runner(drafter)
    g = torch.Generator().manual_seed(0)
    dtype = runner.dtype
    hidden = int(drafter.config.hidden_size)
    feats = torch.randn(ctx, len(spec.target_layer_ids) * spec.target_hidden_size, generator=g).to(device, dtype)
    item = (feats, torch.randn(ctx, hidden, generator=g).to(device, dtype)) if runner.context_reads_tokens else feats
    context = runner.context(iter([item]), [ctx])
    length = 3 if _pass_tokens(drafter) == 1 else spec.block_size  # a chain: its context row, then one step
    emb = torch.randn(1, length, hidden, generator=g).to(device, dtype)
    one = torch.zeros(1, dtype=torch.long, device=device)
    read = torch.arange(1, length, device=device)[None]

    def one_pass(_: Any) -> torch.Tensor:
        return runner.block_rows(context, emb, one + ctx, one).rows(one[:, None], read)[0] @ head.T

    return one_pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from ...common.fileio import check_outputs_apart
    from ...core.results.results_file import check_results_path

    # The profile never lands on an input, nor anywhere in a model folder (a new file there is read by the next
    # loader, e.g. a stray *.index.json), before any work.
    drafter_paths = [d for d in (args.drafter or "").split(",") if d]
    check_outputs_apart([("--from-csv", args.from_csv), ("--states", args.states)], files=[("--out", args.out)],
                        models=[("--target", args.target), *(("--drafter", d) for d in drafter_paths)])
    out = check_results_path(args.out, "--out", "profile.json")
    modes = sum(bool(x) for x in (args.roofline, args.from_csv))
    if modes > 1:
        raise ArgumentError("--roofline and --from-csv are two ways to one profile: give one")
    if args.batch_size < 1:
        raise ArgumentError(f"--batch-size {args.batch_size}: must be >= 1")
    if args.batch_size != 1 and not args.from_csv:
        raise ArgumentError(f"--batch-size {args.batch_size}: measured and roofline profiles time one sequence "
                            "(batch 1); drop --batch-size")
    if not args.from_csv:
        _check_measuring(args, drafter_paths)
    contexts = sorted(set(parse_int_list("--contexts", args.contexts, 1)))
    repeats = parse_int("--repeats", args.repeats, 1)
    command = "python tools/profile_costs.py " + " ".join(shlex.quote(a) for a in argv)
    overhead = parse_overhead(args.overhead)
    today = datetime.date.today().isoformat()
    target: dict[str, Any] = {}
    drafters: list[Any] = []
    if args.target:
        from ...cache.target import read_target_config

        target = target_identity(read_target_config(args.target))
    elif args.states:
        from ...cache.states import StateCache

        m = StateCache(args.states).manifest.target
        target = {k: m.get(k) for k in ("hidden_size", "num_layers", "vocab_size")}
    if args.drafter:
        from ...core.checkpoints.load import load_drafter

        drafters = [load_drafter(path, device="cpu") for path in args.drafter.split(",") if path]
    ids = [drafter_identity(d) for d in drafters]
    if args.from_csv:
        seconds = draft_seconds_list(args.draft_seconds, len(drafters))
        verify, draft = from_csv(args.from_csv, seconds[0] if seconds else None)
        if not target:
            warnings.warn(f"--from-csv {args.from_csv}: no --target or --states, so the profile records no target "
                          "and no cache can check it was measured for its own; give --states CACHE (or --target)",
                          stacklevel=2)
        others = tuple((who, {0: sec}) for who, sec in zip(ids[1:], (seconds or [])[1:], strict=True))
        profile = CostProfile("user", verify, draft, target, ids[0] if ids else {}, "", "", args.batch_size, today,
                              f"--from-csv {args.from_csv}", others)
        return _finish(out, profile, overhead=overhead)
    if not args.target:
        raise ArgumentError("--target TARGET_DIR is needed to measure (or --roofline); --from-csv needs none")
    if out.exists() and not _partial(out):
        raise ArgumentError(f"--out {out} exists: give another path (a finished profile is never overwritten)")
    tokens = _tokens(args, max((d.spec.block_size for d in drafters), default=None))
    if args.roofline:
        if not (args.bandwidth_gbs and args.bandwidth_gbs > 0 and args.peak_tflops and args.peak_tflops > 0):
            raise ArgumentError("--roofline needs the device's --bandwidth-gbs and --peak-tflops (your numbers: "
                                "the estimate is labelled with them)")
        from ...cache.target import DTYPES

        verify, drafts, stated = roofline(args.target, drafters, contexts, tokens, DTYPES[args.dtype].itemsize,
                                          args.bandwidth_gbs, args.peak_tflops)
        profile = CostProfile("roofline", verify, drafts[0], target, ids[0] if ids else {}, "", args.dtype,
                              args.batch_size, today, stated, tuple(zip(ids[1:], drafts[1:], strict=True)))
        return _finish(out, profile, overhead=overhead)
    return _measure(args, out, target, drafters, ids, contexts, tokens, repeats, command, today)


def _check_measuring(args: argparse.Namespace, drafter_paths: list[str]) -> None:
    """What measuring (or a roofline) needs, refused before any model is read: a drafter (without one every
    drafter pass would be priced at 0 s), a device this machine has, a dtype, a 1-token row (plain decoding's
    step, the speedup's baseline) and a roofline's figures in a device's range."""
    from ...cache.target import DTYPES

    if args.dtype not in DTYPES:
        raise ArgumentError(f"--dtype {args.dtype}: one of {', '.join(DTYPES)}")
    if args.tokens and 1 not in _tokens(args, None):
        raise ArgumentError(f"--tokens {args.tokens}: needs 1 (plain decoding's step, the speedup's baseline), "
                            "e.g. --tokens 1-9")
    if args.roofline:
        if args.bandwidth_gbs is None or args.peak_tflops is None:
            raise ArgumentError("--roofline needs the device's --bandwidth-gbs and --peak-tflops (your numbers: "
                                "the estimate is labelled with them)")
        for option, value, lo, hi in (("--bandwidth-gbs", args.bandwidth_gbs, 0.1, 1e6),
                                      ("--peak-tflops", args.peak_tflops, 1e-3, 1e6)):
            if value is not None and not (math.isfinite(value) and lo <= value <= hi):
                raise ArgumentError(f"{option} {value:g}: outside any device's range ({lo:g} to {hi:g}); give "
                                    "your device's figure, e.g. --bandwidth-gbs 3350 --peak-tflops 989")
    else:
        from ...cache.target import TargetError, check_device

        try:
            check_device(args.device)
        except TargetError as e:
            raise ArgumentError(str(e)) from None
    if not drafter_paths:
        raise ArgumentError("--drafter DRAFTER_DIR is needed to measure or estimate a profile: without it every "
                            "drafter pass would be priced at 0 s (free drafting); name the drafter(s) to be served")


def _measure(args: argparse.Namespace, out: Path, target: dict[str, Any], drafters: list[Any],
             ids: list[dict[str, Any]], contexts: list[int], tokens: list[int], repeats: int, command: str,
             today: str) -> int:
    import torch

    from ...cache.target import DTYPES, load_target

    device = torch.device(args.device)
    settings = {"tokens": tokens, "dtype": args.dtype, "device": str(device), "target": target,
                "drafter": ids[0] if ids else {}, "repeats": repeats}
    if len(ids) > 1:
        settings["others"] = ids[1:]
    state: dict[str, Any] = {"partial": True, "settings": settings, "verify": {}, "draft": {},
                             "others": [{} for _ in ids[1:]], "spread": {}, "flags": []}
    if out.exists():
        try:
            old = json.loads(out.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get("partial"):
            if old.get("settings") != settings:
                raise ArgumentError(f"--out {out}: an unfinished profile measured with other settings; give another "
                                    "--out or the same options to resume it")
            state = old
            say(f"resuming {out}: contexts {sorted(int(c) for c in state['verify'])} already measured")
        elif old is not None:
            raise ArgumentError(f"--out {out} exists: give another path (a finished profile is never overwritten)")
    model = load_target(args.target, args.dtype).model.to(device)
    head = embed = None
    drafters = [d.to(device=device, dtype=DTYPES[args.dtype]).eval() for d in drafters]
    if drafters:
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    clock = StepClock(device)
    vocab = int(target.get("vocab_size") or model.config.vocab_size)
    for i, ctx in enumerate(contexts):
        if str(ctx) in state["verify"]:
            continue
        rows, drafts, spread, flags, timed = measure_context(model, drafters, head, ctx, tokens, clock, repeats,
                                                             device, vocab, embed)
        state["verify"][str(ctx)] = rows
        state.setdefault("repeats", {})[str(ctx)] = timed
        state.setdefault("spread", {})[str(ctx)] = spread
        state["flags"] = [*state.get("flags", []), *flags]
        for flag in flags:
            say(f"flagged: {flag}")
        state["draft"][str(ctx)] = drafts[0]
        for other, sec in zip(state["others"], drafts[1:], strict=True):
            other[str(ctx)] = sec
        _write(out, state)  # after every context: an interrupted run resumes here
        say(f"context {ctx} [{i + 1}/{len(contexts)}]: verify {rows[0][1] * 1e3:.2f} ms at {rows[0][0]} token(s), "
            f"{rows[-1][1] * 1e3:.2f} ms at {rows[-1][0]}; drafter pass " + ", ".join(f"{d * 1e3:.2f}" for d in drafts)
            + " ms")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    others = tuple((who, {int(c): float(sec) for c, sec in d.items()})
                   for who, d in zip(ids[1:], state.get("others") or [], strict=True))
    profile = CostProfile("measured", {int(c): tuple((int(n), float(s)) for n, s in r) for c, r in state["verify"].items()},
                          {int(c): float(s) for c, s in state["draft"].items()}, target, ids[0] if ids else {}, name,
                          args.dtype, 1, today, command, others,
                          spread={int(c): tuple((int(n), float(x)) for n, x in r) for c, r in state["spread"].items()},
                          flags=tuple(state["flags"]),
                          repeats={int(c): tuple((int(n), tuple(map(float, t))) for n, t in r)
                                   for c, r in state.get("repeats", {}).items()})
    return _finish(out, profile, replace=True, overhead=parse_overhead(args.overhead))


def _partial(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("partial"))
    except (OSError, ValueError, AttributeError):
        return False


def parse_overhead(text: str | None) -> dict[str, float]:
    """``--overhead block=S,ddtree=S,chain=S``: seconds per cycle by kind of setting, checked before any work."""
    from ...core.costs.serving import CYCLE_KINDS

    if text is None:
        return {}
    out: dict[str, float] = {}
    for part in (x.strip() for x in str(text).split(",") if x.strip()):
        kind, _, value = part.partition("=")
        try:
            sec = float(value)
        except ValueError:
            sec = math.nan
        if kind.strip() not in CYCLE_KINDS or not (math.isfinite(sec) and 0 <= sec <= 3600) or kind.strip() in out:
            raise ArgumentError(f"--overhead {text}: give KIND=SECONDS once per kind, KIND one of "
                                f"{', '.join(CYCLE_KINDS)}, seconds a finite number from 0 to 3600 (got {part!r})")
        out[kind.strip()] = sec
    return out


def _finish(out: Path, profile: CostProfile, replace: bool = False, overhead: dict[str, float] | None = None) -> int:
    if overhead:
        profile = dataclasses.replace(profile, overhead=dict(overhead))
    if out.exists() and not replace:
        raise ArgumentError(f"--out {out} exists: give another path (a profile is never overwritten)")
    try:
        _write(out, profile.to_dict())
    except ProfileError as e:
        raise DFlashCBError(str(e)) from None
    say(f"wrote {out}: {profile.label()}; verified tokens {min(r[0][0] for r in profile.verify.values())} to "
        f"{profile.max_verified}, contexts {sorted(profile.verify)}")
    return 0


command = cli.command(main)  # the ``dflash-profile`` console command
