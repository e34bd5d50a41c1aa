"""Precompute a cache of target hidden states (the core of tools/precompute_states.py and merge_states.py).

Split by job: ``plan`` (arguments, inputs, output folder and fingerprint, checked before the
weights load), ``compute_dtype`` (the CPU probe behind ``--compute-dtype auto``), ``run`` (the
resumable run: state, per-sample prefill, shard writes), ``journal`` and ``progress`` (the two
append-only records a killed run resumes from), ``merge`` (parts into one cache), ``errors`` (the
error type they share) and ``cli``. Messages go to the ``logging`` loggers of these modules; the
command lines show them on stderr (``dflash_cb.common.cli.run``).
"""

from .cli import args_from_cli, build_parser, command, main, merge_command, merge_main
from .compute_dtype import ComputeDtypeChoice, choose_compute_dtype, matmul_gflops
from .errors import PrecomputeError
from .merge import merge_parts
from .plan import (
    COMPLETION_SOURCES,
    DTYPE_NAMES,
    JOURNAL_NAME,
    LOG_NAME,
    PROGRESS_NAME,
    CompletionSource,
    DtypeProbe,
    Plan,
    PrecomputeArgs,
    prepare,
)
from .run import (
    agreement_totals,
    build_manifest,
    compute_sample,
    execute,
    format_summary,
    run_precompute,
    save_safetensors,
)

__all__ = [
    "COMPLETION_SOURCES", "DTYPE_NAMES", "JOURNAL_NAME", "LOG_NAME", "PROGRESS_NAME", "CompletionSource",
    "ComputeDtypeChoice", "DtypeProbe", "Plan", "PrecomputeArgs", "PrecomputeError", "agreement_totals",
    "args_from_cli", "build_manifest", "build_parser", "choose_compute_dtype", "command", "compute_sample", "execute",
    "format_summary", "main", "matmul_gflops", "merge_command", "merge_main", "merge_parts", "prepare",
    "run_precompute", "save_safetensors",
]
