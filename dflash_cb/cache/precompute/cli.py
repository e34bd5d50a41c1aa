"""Command lines of tools/precompute_states.py and tools/merge_states.py: parsing and the exit code only.

User errors (the package's own errors, OS errors on user paths) become one ``error:`` line and exit
code 2 through ``dflash_cb.common.cli.run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...common import cli
from ...common.threads import THREADS_HELP, parse_threads, set_threads
from ..prompt_sets import PRESETS
from .compute_dtype import COMPUTE_DTYPE_NAMES, MARGIN_HELP
from .errors import PrecomputeError
from .merge import merge_parts
from .plan import COMPLETION_SOURCES, DTYPE_NAMES, PrecomputeArgs
from .run import run_precompute


def _int_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if isinstance(value, int):
        value = [value]
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise PrecomputeError(f"expected a comma-separated list of integers, got {value!r}") from None


def _json_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise PrecomputeError(f"--chat-template-kwargs: not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise PrecomputeError(f"--chat-template-kwargs must be a JSON object, got {value!r}")
    return value


# YAML keys named like the options' newer spellings (--server-timeout) map to the fields they set.
_YAML_ALIASES = {"server_timeout": "sglang_timeout", "server_retries": "sglang_retries"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precompute_states.py",
        description="Precompute a DFlash cache of target hidden states (see cached_states/README.md). "
                    "Every option can also come from --config FILE (YAML, same names); the command line wins.")
    S = argparse.SUPPRESS  # unset options stay absent, so YAML values are not overridden by defaults
    p.add_argument("--config", help="YAML file with any of the options below")
    p.add_argument("--target", default=S, help="Hugging Face model folder (or hub id)")
    p.add_argument("--prompts", default=S, help="prompt JSONL (id, category, messages|text|input_ids)")
    p.add_argument("--out", default=S, help="cache folder, e.g. cached_states/qwen36-27b-v1")
    p.add_argument("--layers", default=S, help="target layer ids, e.g. 1,16,31,46,61 (id i = hidden_states[i+1])")
    p.add_argument("--drafter-config", default=S,
                   help="drafter config.json giving the layer ids; several, comma-separated: the union of their layers "
                        "(one cache for several drafters, each reading its own)")
    p.add_argument("--reference", default=S, choices=COMPLETION_SOURCES, help="completion source (default local)")
    p.add_argument("--sglang-url", default=S, help="SGLang server for --reference sglang")
    p.add_argument("--vllm-url", default=S, help="vLLM server (OpenAI API) for --reference vllm")
    p.add_argument("--completions", default=S, help='JSONL of {"id", "output_ids"} for --reference file')
    p.add_argument("--max-new-tokens", type=int, default=S, help="generation length (default 256)")
    p.add_argument("--chat-template-kwargs", default=S, help='JSON, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--dtype", default=S, choices=DTYPE_NAMES, help="storage dtype of the states (default bfloat16)")
    p.add_argument("--compute-dtype", default=S, choices=COMPUTE_DTYPE_NAMES,
                   help="dtype the target computes in (default auto: with bfloat16 storage, time a matmul of the "
                        "target's width in both dtypes, at least one full matmul each: well under a second unless "
                        f"bfloat16 is emulated at a large width; {MARGIN_HELP}; with float32 storage, "
                        "float32). A resumed run keeps the cache's compute dtype")
    p.add_argument("--prompt-set", default=S, choices=sorted(PRESETS),
                   help="instead of --prompts: the DFlash authors' benchmark prompts, built with the target's "
                        "tokenizer into <out>.prompts.jsonl (needs the prompts extra; docs/precompute.md)")
    p.add_argument("--prompt-data-dir", default=S,
                   help="with --prompt-set: the datasets saved by build_prompts.py --save-data (no hub needed)")
    p.add_argument("--prompt-max-samples", type=int, default=S,
                   help="with --prompt-set: rows per set (default: the preset's own counts)")
    p.add_argument("--completions-only", action="store_true", default=S,
                   help="with a server reference: journal its completions (reference_completions.jsonl) and stop; "
                        "the prefill then runs on a big-RAM host with --reference file --completions that file")
    p.add_argument("--device", default=S, help="where the target's prefill runs: cpu (default), cuda or cuda:N (a "
                   "spare GPU of the serving host; the states still land in CPU memory)")
    p.add_argument("--topk-logprobs", type=int, default=S, help="store top-K log-probs per position (0 = off)")
    p.add_argument("--num-shards", type=int, default=S, help="split the work into N parts (default 1)")
    p.add_argument("--shard-index", type=int, default=S, help="which part this run computes (0-based)")
    p.add_argument("--samples-per-shard", type=int, default=S, help="samples per shard file (default 1)")
    p.add_argument("--stop-token-ids", default=S, help="comma-separated; default: the target's eos ids")
    p.add_argument("--tokenizer", default=S, help="tokenizer for text/messages prompts (default: --target)")
    p.add_argument("--no-export-head", dest="export_head", action="store_false", default=S,
                   help="do not export the target's embedding and head")
    p.add_argument("--overwrite", action="store_true", default=S,
                   help="replace a cache in --out made with other arguments")
    p.add_argument("--max-in-flight", type=int, default=S,
                   help="concurrent server requests (default 8 for SGLang; 1 for vLLM, whose speculative counters "
                        "are per request only one at a time)")
    p.add_argument("--baseline-server", default=S, metavar="URL",
                   help="a plain (non-speculative) server of the same target, of the --reference kind: every prompt "
                        "is sent there too, one at a time, and both wall times kept (the served speed; "
                        "docs/served-check.md)")
    p.add_argument("--server-timeout", "--sglang-timeout", dest="sglang_timeout", type=float, default=S,
                   metavar="SECONDS",
                   help="seconds per SGLang or vLLM request, whole answer included (default 600)")
    p.add_argument("--server-retries", "--sglang-retries", dest="sglang_retries", type=int, default=S, metavar="N",
                   help="retries per SGLang or vLLM request (default 5)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=S, help="no progress bar")
    p.add_argument("--threads", default=None, help=THREADS_HELP)
    return p


def args_from_cli(argv: Sequence[str] | None = None) -> PrecomputeArgs:
    """Parse the command line over the optional --config YAML over the defaults."""
    ns = vars(build_parser().parse_args(argv))
    ns.pop("threads")  # applied by the command itself (_precompute), not by parsing
    values: dict[str, Any] = {}
    config = ns.pop("config", None)
    if config:
        import yaml

        try:
            loaded = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise PrecomputeError(f"--config {config}: {e}") from e
        if not isinstance(loaded, dict):
            raise PrecomputeError(f"--config {config}: expected a mapping of option names to values")
        known = {f.name for f in dataclasses.fields(PrecomputeArgs)}
        for k, v in loaded.items():
            key = str(k).replace("-", "_")
            key = _YAML_ALIASES.get(key, key)
            if key == "no_export_head":
                key, v = "export_head", not v
            if key not in known:
                raise PrecomputeError(f"--config {config}: unknown option {k!r}; known: {sorted(known)}")
            values[key] = v
    values.update(ns)
    if "layers" in values:
        values["layers"] = _int_list(values["layers"])
    if "stop_token_ids" in values:
        values["stop_token_ids"] = _int_list(values["stop_token_ids"])
    if "chat_template_kwargs" in values:
        values["chat_template_kwargs"] = _json_dict(values["chat_template_kwargs"] or {})
    if isinstance(values.get("drafter_config"), list):  # a YAML list of configs
        values["drafter_config"] = ",".join(str(v) for v in values["drafter_config"])
    for k in ("target", "prompts", "out", "drafter_config", "sglang_url", "vllm_url", "baseline_server", "completions", "tokenizer",
              "prompt_data_dir"):
        if values.get(k) is not None:
            values[k] = str(values[k])
    return PrecomputeArgs(**values)


def _precompute(argv: Sequence[str] | None) -> int:
    set_threads(parse_threads(build_parser().parse_args(argv).threads))
    run_precompute(args_from_cli(argv))
    return 0


def _merge(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="merge_states.py",
                                description="Merge --num-shards parts of a precompute into one cache.")
    p.add_argument("--out", required=True, help="the merged cache folder")
    p.add_argument("parts", nargs="+", help="part folders (each a finished precompute_states.py --out)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing cache in --out")
    p.add_argument("--copy", action="store_true", help="copy shards instead of hard-linking them")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the parts' shards")
    ns = p.parse_args(argv)
    merge_parts(ns.out, ns.parts, overwrite=ns.overwrite, link=not ns.copy, verify=not ns.no_verify)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """tools/precompute_states.py: 0 on success, 2 on a user error (one ``error:`` line on stderr)."""
    return cli.run(_precompute, argv)


def merge_main(argv: Sequence[str] | None = None) -> int:
    """tools/merge_states.py: 0 on success, 2 on a user error."""
    return cli.run(_merge, argv)


command = cli.command(_precompute)  # ``dflash-precompute``
merge_command = cli.command(_merge)  # ``dflash-merge``
