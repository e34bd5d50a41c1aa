"""How many CPU threads torch uses: the one rule of every command line's ``--threads`` (and the demo's).

torch's default is every core the machine has. When other processes share the machine (another training
run, a data loader, a second evaluation) its threads wait on each other, and a run can take many times as
long as with one thread (docs/performance.md). So the default is the cores *this process may use*
(``os.sched_getaffinity``: a ``taskset``, a container's CPU set or a scheduler's allocation), at most one
per physical core (hyper-threads share a core's arithmetic units), and at most ``OMP_NUM_THREADS`` when
that is set (the variable a user or a launcher sets to say how many threads a process gets; torch reads
it too). Pure but for reading the machine's topology; torch is imported only to apply the setting.
"""

from __future__ import annotations

import os
from pathlib import Path

from .arguments import parse_int

THREADS_HELP = ("CPU threads for torch (default: the cores this process may use, at most one per physical core "
                "and at most OMP_NUM_THREADS; use 1 when other jobs share the machine)")


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity call
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int | None:
    """How many physical cores the logical ``cpus`` cover (Linux sysfs topology); None when unknown."""
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores) or None


def default_threads() -> int:
    """The cores this process may use, capped at the physical cores they cover and at ``OMP_NUM_THREADS``."""
    cpus = usable_cpus()
    physical = physical_cores(cpus)
    n = min(len(cpus), physical) if physical else len(cpus)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        n = min(n, int(omp))
    return max(1, n)


def parse_threads(text: str | None, option: str = "--threads") -> int:
    """``--threads N`` (an integer >= 1), or ``default_threads()`` when it was not given."""
    if text is None:
        return default_threads()
    return parse_int(option, text, 1, note="the number of CPU threads torch may use")


def set_threads(threads: int) -> int:
    """Make torch use ``threads`` CPU threads (intra-op); returns it, for the summary and results.json."""
    import torch

    torch.set_num_threads(threads)
    return threads


def oversubscribed(threads: int, load: float | None = None, cpus: int | None = None) -> str | None:
    """A line saying that ``threads`` torch threads join a machine whose load already fills its cores (each
    thread then waits its turn, and two spinning threads take longer than one), or None. ``load``: the 1-minute
    load average (read here when None); ``cpus``: the cores this process may use."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            return None
    cpus = cpus or len(usable_cpus())
    if threads <= 1 or load + threads <= cpus + 0.5:
        return None
    return (f"the machine's load ({load:.1f}) and {threads} torch threads exceed its {cpus} core(s): each thread "
            "waits its turn; --threads 1 is faster while other work runs")
