"""The command line of ``tools/extract_drafter.py`` (the work is ``checkpoints.extract_drafter``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ...common import cli

USAGE = """Strip a training checkpoint down to a drafter folder (config.json + model.safetensors).

    python tools/extract_drafter.py --ckpt lightning_logs/.../step=1000.ckpt --out drafters/step1000 \\
        [--config drafter_config.json] [--prefix drafter.]

Loads with torch.load(weights_only=True), drops optimizer/scheduler/loop state, finds the drafter's
key prefix, and refuses a result with missing or unexpected keys. The folder loads both in
dflash_cb (DFlashDrafter.from_pretrained) and in the reference dflash.model.DFlashDraftModel.
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt",
                   help="Lightning .ckpt, a Hugging Face checkpoint-N folder, a SpecForge <run>-stepN folder, a plain "
                        "loop's torch.save'd checkpoint (the drafter's state dict in any entry) or a .safetensors file")
    source.add_argument("--from-target", "--mtp-from", dest="from_target", default=None, metavar="TARGET",
                        help="the target's model folder: write the drafter it ships inside its own checkpoint (Qwen3.5 "
                             "/ Qwen3.6: its MTP head, the mtp.* weights) as a drafter folder; only those tensors are "
                             "read (--mtp-from: the same, its earlier name)")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="with --from-target: the chain length K the drafter's config records (default 3, the servers' "
                        "common one; the replay takes any K with --block-size K+1)")
    p.add_argument("--out", required=True,
                   help="drafter folder to write: new, empty, or an earlier drafter folder (replaced atomically)")
    p.add_argument("--overwrite", action="store_true",
                   help="write config.json and model.safetensors into a non-empty folder that is not a drafter "
                        "folder (its other files are kept; the folder holding --ckpt is always refused)")
    p.add_argument("--config", default=None,
                   help="drafter config.json (default: hyper_parameters.drafter_config in the checkpoint)")
    p.add_argument("--prefix", default=None, help="key prefix of the drafter in the checkpoint (default: found)")
    args = p.parse_args(argv)
    from ...common.arguments import ArgumentError
    from ...common.fileio import check_outputs_apart
    from ...core.checkpoints.load import (
        describe_dropped,
        describe_source,
        extract_drafter,
        extract_from_target,
        read_drafter_config,
    )
    from ...core.drafters.chain import ChainFamily

    MAX_SPECULATIVE_TOKENS = ChainFamily.max_speculative_tokens  # noqa: N806
    # Options of the other source would be silently ignored: refused, naming them.
    if args.from_target and (args.config or args.prefix):
        raise ArgumentError("--from-target (--mtp-from) reads the target's own config and weights: drop --config and "
                            "--prefix (they are for --ckpt)")
    if args.ckpt and args.speculative_tokens is not None:
        raise ArgumentError("--speculative-tokens is for --from-target / --mtp-from (the chain length its config "
                            "records); a "
                            "--ckpt drafter's config says its own: drop it, or score another K with "
                            "tools/eval_drafter.py --speculative-tokens")
    if args.from_target:
        chain = {} if args.speculative_tokens is None else {"speculative_tokens": args.speculative_tokens}
        if chain and not 1 <= args.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ArgumentError(f"--speculative-tokens {args.speculative_tokens}: a chain drafts 1 to "
                                f"{MAX_SPECULATIVE_TOKENS} tokens a cycle (the servers' num_speculative_tokens, "
                                "commonly 3)")
        info = extract_from_target(args.from_target, args.out, overwrite=args.overwrite, **chain)
        print(f"wrote {args.out}: the target's {info['family']} head, {info['tensors']} tensors, {info['params'] / 1e6:.2f}M "
              f"parameters (from {', '.join(info['files'])})")
        return 0

    check_outputs_apart([("--ckpt", args.ckpt), ("--config", args.config)], folders=[("--out", args.out)])

    config = read_drafter_config(args.config) if args.config else None
    info = extract_drafter(args.ckpt, args.out, config=config, prefix=args.prefix, overwrite=args.overwrite)
    print(f"wrote {args.out}: {info['tensors']} tensors, {info['params'] / 1e6:.2f}M parameters "
          f"(from {describe_source(info['entry'], info['prefix'])}; {describe_dropped(info)})")
    return 0


command = cli.command(main)  # the ``dflash-extract`` console command
