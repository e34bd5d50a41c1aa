"""Which dtype the prefill computes in: measured on this CPU, checked against the memory available.

The storage dtype (``--dtype``) is what the cache holds; the compute dtype is what the target runs
in. On a CPU without bf16 units (no AVX512-BF16 / AMX) bfloat16 matmuls are emulated and several
times slower than float32, so ``auto`` times one matmul of the target's width in both dtypes with
the threads the run uses and takes float32 when it is faster *and* fits in memory. Float32 compute
with bfloat16 storage loses nothing: the states are rounded once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

COMPUTE_DTYPE_NAMES = ("auto", "bfloat16", "float32")
# float32 is chosen only when (weights + activations) * MEMORY_FACTOR + MEMORY_SLACK fit in the memory
# available: the factor covers allocator fragmentation and estimate error, the slack the interpreter,
# torch and transformers themselves.
MEMORY_FACTOR = 1.15
MEMORY_SLACK = 2 << 30
PROBE_ROWS = 256  # rows of the probe matmul: a prefill multiplies thousands of positions at once
MARGIN_HELP = (f"float32 is chosen only if it measures faster and the float32 weights plus the largest "
               f"prompt's activations, times {MEMORY_FACTOR:g}, plus {MEMORY_SLACK >> 30} GiB, fit in the "
               "available memory (MemAvailable, or the cgroup limit if lower)")

Gflops = Callable[[torch.dtype, int], float]
Available = Callable[[], int | None]


def matmul_gflops(dtype: torch.dtype, hidden: int, seconds: float = 0.1) -> float:
    """GFLOP/s of a ``[256, hidden] @ [hidden, hidden]`` matmul in ``dtype`` on torch's current threads.

    Runs at least one full matmul and otherwise about ``seconds`` (a 5120-wide one in emulated
    bfloat16 takes about a second).
    """
    g = torch.Generator().manual_seed(0)
    a = torch.randn(PROBE_ROWS, hidden, generator=g).to(dtype)
    b = torch.randn(hidden, hidden, generator=g).to(dtype)
    a[:8] @ b  # warm-up (first-call dispatch, page faults) at a fraction of the cost
    n, t0 = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return 2.0 * PROBE_ROWS * hidden * hidden * n / elapsed / 1e9


def available_memory_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, or the cgroup v2 limit's headroom if lower."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def activation_bytes(cfg: Any, tokens: int, num_layer_ids: int, elem: int, store_elem: int, chunk: int) -> int:
    """One prompt's activations in the tool's prefill (an estimate, generous rather than tight).

    A few ``[T, H]`` residual/norm tensors, the MLP's three ``[T, I]``, float32 attention scores
    (``heads * T^2``, SDPA's CPU path), the captured ``[T, L*H]`` buffer, one logits chunk.
    """
    h, inter = cfg.hidden_size, cfg.intermediate_size or 4 * cfg.hidden_size
    heads = cfg.num_attention_heads or max(cfg.hidden_size // 128, 1)
    return (tokens * (4 * h + 3 * inter) * elem + heads * tokens * tokens * 4
            + tokens * num_layer_ids * h * store_elem + chunk * cfg.vocab_size * (elem + 4))


@dataclass
class ComputeDtypeChoice:
    dtype: str
    reason: str
    gflops: dict[str, float] = field(default_factory=dict)  # measured GFLOP/s per dtype (auto only)
    float32_need_bytes: int | None = None
    available_bytes: int | None = None

    def record(self) -> dict[str, Any]:
        """What precompute_log.json keeps of the choice."""
        return {"compute_dtype": self.dtype, "reason": self.reason,
                "gflops": {k: round(v, 2) for k, v in self.gflops.items()},
                "float32_need_bytes": self.float32_need_bytes, "available_bytes": self.available_bytes,
                "torch_threads": torch.get_num_threads()}


def choose_compute_dtype(requested: str, storage: str, hidden: int, float32_need_bytes: int,
                         gflops: Gflops = matmul_gflops,
                         available: Available = available_memory_bytes) -> ComputeDtypeChoice:
    """Resolve ``--compute-dtype``; ``gflops`` and ``available`` are injectable (tests, other probes)."""
    if requested != "auto":
        return ComputeDtypeChoice(requested, "given by --compute-dtype")
    if storage == "float32":
        # bf16 compute would round the states that float32 storage is meant to keep exact
        return ComputeDtypeChoice("float32", "the storage dtype is float32")
    measured = {"float32": gflops(torch.float32, hidden), "bfloat16": gflops(torch.bfloat16, hidden)}
    avail = available()
    need = int(float32_need_bytes * MEMORY_FACTOR) + MEMORY_SLACK
    figures = f"float32 {measured['float32']:.1f} GFLOP/s, bfloat16 {measured['bfloat16']:.1f} GFLOP/s"
    if measured["float32"] <= measured["bfloat16"]:
        dtype, reason = "bfloat16", f"bfloat16 is faster on this CPU ({figures})"
    elif avail is not None and need > avail:
        dtype, reason = "bfloat16", (f"float32 is faster ({figures}) but needs {need / 2**30:.1f} GiB with the "
                                     f"margin, {avail / 2**30:.1f} GiB are available")
    else:
        dtype, reason = "float32", f"float32 is faster on this CPU ({figures}) and fits in memory"
    return ComputeDtypeChoice(dtype, reason, measured, float32_need_bytes, avail)
