"""A real HTTP server on 127.0.0.1 that speaks vLLM's OpenAI-compatible API and exports its counters.

Written from vLLM's own definitions (its ``CompletionRequest`` / ``CompletionResponseChoice``, its
``/v1/models`` cards, its Prometheus metrics; docs/served-check.md, "vLLM"), not from our client:

- ``POST /v1/completions`` takes the prompt as a list of token ids; ``return_token_ids`` adds
  ``token_ids`` and ``prompt_token_ids`` to the choice; a ``model`` it does not serve is HTTP 404, a
  prompt + ``max_tokens`` beyond ``max_model_len`` HTTP 400; it stops at ``stop_token_ids`` and, unless
  ``ignore_eos``, at the target's EOS; ``usage`` counts the tokens.
- ``GET /metrics`` is the Prometheus text format as ``prometheus_client`` writes it: ``# HELP`` and
  ``# TYPE`` lines, counters with the ``_total`` suffix and a ``_created`` twin, labels ``model_name``
  and ``engine`` (and ``finished_reason``, ``position``), a latency histogram beside them. The counters are
  server-wide and, with ``engines=2``, split over two engines as under data parallelism.
- Per verification round of a request: ``num_drafts`` += 1, ``num_draft_tokens`` += the drafts verified,
  ``num_accepted_tokens`` += the drafts accepted (before the round's output is cut at a stop token or at
  ``max_tokens``), ``num_accepted_tokens_per_pos{position=j}`` += 1 for every j below the accepted count.
  Per finished request ``request_success{finished_reason}`` += 1 and ``generation_tokens`` += its tokens.
  ``num_requests_running`` counts the requests between arrival and answer.

What a request runs is a ``loop(prompt, max_tokens, stops) -> Run``: the tests pass the reference
full-block loop with a real drafter (tests/support/full_block_loop.py) or :func:`simulated_drafts`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
from local_http import JSONHandler
from local_http import serve as serve_http


@dataclass
class Run:
    output_ids: list[int]  # the completion, cut at the stop token or max_tokens
    accepted: list[int]  # per verification round: drafts accepted, counted before the cut
    verified: list[int] | None = None  # per round: drafts verified (default: num_speculative_tokens each)


Loop = Callable[[list[int], int, set[int]], Run]

FINISH_REASONS = ("stop", "length", "abort")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class FakeVLLM:
    loop: Loop
    served_name: str
    root: str
    num_spec_tokens: int | None = 15  # None: not speculating (no spec_decode counters)
    eos_token_id: int = 2
    max_model_len: int = 512
    engines: int = 1
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /server_info is served
    method: str = "dflash"
    drafter: str | None = None
    stats: bool = True  # False: --disable-log-stats (no vllm: metrics)
    # --per-request-spec-decode-metrics: "summary" or "detailed" (with per_step_accepted); None: off (the default)
    per_request: str | None = None
    serves_metrics: bool = True  # False: no /metrics endpoint at all (404)
    # the request's own time in the answer's ``metrics`` (tokens_per_second, generation_time_ms), as vLLM fills
    # them when enabled; None: not sent
    reports_timing: dict[str, Any] | None = None
    # fault and traffic knobs
    fail_first: int = 0  # this many /v1/completions answered 503 without running
    drop_first: int = 0  # this many run, then the connection is closed without an answer
    garbage_first: int = 0  # this many run, then answered with broken JSON
    metrics_garbage_first: int = 0  # this many /metrics answered with an HTML error page
    late_stats_s: float = 0.0  # a request's counters land this long after its answer
    bos_first: bool = False  # answer as if it had put a BOS token before the prompt
    ignores_return_token_ids: bool = False  # an older vLLM: no token_ids in the choice
    preempt: set[tuple[int, ...]] = field(default_factory=set)  # prompts preempted once while running
    unavailable: set[tuple[int, ...]] = field(default_factory=set)  # prompts answered 503 without running
    on_arrival: dict[tuple[int, ...], Callable[[], None]] = field(default_factory=dict)  # called before running
    hold: dict[tuple[int, ...], threading.Event] = field(default_factory=dict)  # wait for it before running
    # what happened
    calls: int = 0
    metrics_calls: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    # per finished request, what its own rounds counted (the test's ground truth)
    ledger: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.created = time.time()
        self.counters: list[dict[str, float]] = [dict.fromkeys(
            ("drafts", "draft_tokens", "accepted", "generation", "prompt", "preemptions"), 0.0)
            for _ in range(self.engines)]
        k = self.num_spec_tokens or 0
        self.per_pos: list[list[float]] = [[0.0] * k for _ in range(self.engines)]
        self.success: list[dict[str, float]] = [dict.fromkeys(FINISH_REASONS, 0.0) for _ in range(self.engines)]
        self.running = [0] * self.engines
        self.arrivals = 0

    # -- the endpoints -------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        card = {"id": self.served_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.root, "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{int(time.time() * 1e6)}", "object": "model_permission",
                                "created": int(time.time()), "allow_sampling": True}]}
        return {"object": "list", "data": [card]}

    def server_info(self) -> dict[str, Any]:
        spec = None if self.num_spec_tokens is None else {
            "method": self.method, "model": self.drafter, "num_speculative_tokens": self.num_spec_tokens,
            "draft_tensor_parallel_size": 1, "revision": None}
        return {"vllm_config": {"model_config": {"model": self.root, "max_model_len": self.max_model_len},
                                "speculative_config": spec}, "vllm_env": {}, "system_env": {}}

    def metrics_text(self) -> str:
        if not self.stats:
            return "# HELP python_gc_objects_collected_total Objects collected during gc\n" \
                   "# TYPE python_gc_objects_collected_total counter\npython_gc_objects_collected_total 12.0\n"
        name = _escape(self.served_name)
        lines: list[str] = []

        def family(metric: str, kind: str, doc: str, rows: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {metric} {doc}")
            lines.append(f"# TYPE {metric} {kind}")
            for labels, value in rows:
                lines.append(f"{metric}{{{labels}}} {float(value)!r}")

        def base(e: int) -> str:
            return f'engine="{e}",model_name="{name}"'

        with self.lock:
            engines = range(self.engines)
            family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [(base(e), self.running[e]) for e in engines])
            family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [(base(e), 0) for e in engines])
            for metric, key, doc in (("vllm:num_preemptions", "preemptions", "Cumulative number of preemption from the engine."),
                                     ("vllm:prompt_tokens", "prompt", "Number of prefill tokens processed."),
                                     ("vllm:generation_tokens", "generation", "Number of generation tokens processed.")):
                family(f"{metric}_total", "counter", doc, [(base(e), self.counters[e][key]) for e in engines])
                family(f"{metric}_created", "gauge", doc, [(base(e), self.created) for e in engines])
            family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                   [(f'{base(e)},finished_reason="{r}"', self.success[e][r]) for e in engines for r in FINISH_REASONS])
            if self.num_spec_tokens is not None:
                for metric, key, doc in (("vllm:spec_decode_num_drafts", "drafts", "Number of spec decoding drafts."),
                                         ("vllm:spec_decode_num_draft_tokens", "draft_tokens", "Number of draft tokens."),
                                         ("vllm:spec_decode_num_accepted_tokens", "accepted",
                                          "Number of accepted tokens.")):
                    family(f"{metric}_total", "counter", doc, [(base(e), self.counters[e][key]) for e in engines])
                    family(f"{metric}_created", "gauge", doc, [(base(e), self.created) for e in engines])
                family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                       "Accepted tokens per draft position.",
                       [(f'{base(e)},position="{j}"', self.per_pos[e][j]) for e in engines
                        for j in range(self.num_spec_tokens)])
            lines.append("# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.")
            lines.append("# TYPE vllm:e2e_request_latency_seconds histogram")
            done = sum(sum(s.values()) for s in self.success)
            for le in ("0.3", "1.0", "+Inf"):
                lines.append(f'vllm:e2e_request_latency_seconds_bucket{{{base(0)},le="{le}"}} {float(done)!r}')
            lines.append(f"vllm:e2e_request_latency_seconds_count{{{base(0)}}} {float(done)!r}")
            lines.append(f"vllm:e2e_request_latency_seconds_sum{{{base(0)}}} {0.01 * done!r}")
        return "\n".join(lines) + "\n"

    def _count(self, engine: int, prompt: list[int], run: Run, reason: str) -> None:
        k = self.num_spec_tokens
        own = {"prompt": list(prompt), "drafts": 0, "draft_tokens": 0, "accepted": 0,
               "per_pos": [0] * (k or 0), "generation": len(run.output_ids)}
        with self.lock:
            c = self.counters[engine]
            if k is not None:
                verified = run.verified if run.verified is not None else [k] * len(run.accepted)
                for a, v in zip(run.accepted, verified, strict=True):
                    assert 0 <= a <= v <= k
                    c["drafts"] += 1
                    c["draft_tokens"] += v
                    c["accepted"] += a
                    own["drafts"] += 1
                    own["draft_tokens"] += v
                    own["accepted"] += a
                    for j in range(a):
                        self.per_pos[engine][j] += 1
                        own["per_pos"][j] += 1
            c["generation"] += len(run.output_ids)
            c["preemptions"] += tuple(prompt) in self.preempt
            c["prompt"] += len(prompt)
            self.success[engine][reason] += 1
            self.ledger.append(own)

    def complete(self, body: dict[str, Any], engine: int) -> tuple[int, dict[str, Any], Callable[[], None]]:
        """(status, answer or None for a fault, what records the counters)."""
        prompt = body.get("prompt")
        if body.get("model") not in (None, self.served_name):
            return 404, {"object": "error", "message": f"The model `{body.get('model')}` does not exist.",
                         "type": "NotFoundError", "param": None, "code": 404}, lambda: None
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return 400, {"object": "error", "message": "prompt must be token ids here", "type": "BadRequestError",
                         "code": 400}, lambda: None
        max_tokens = int(body.get("max_tokens", 16))
        if len(prompt) + max_tokens > self.max_model_len:
            return 400, {"object": "error", "message": f"This model's maximum context length is {self.max_model_len} "
                         f"tokens. However, you requested {len(prompt) + max_tokens} tokens.",
                         "type": "BadRequestError", "code": 400}, lambda: None
        assert body.get("temperature") == 0, "the fake serves greedy requests only"
        stops = set(body.get("stop_token_ids") or []) | (set() if body.get("ignore_eos") else {self.eos_token_id})
        run = self.loop(list(prompt), max_tokens, stops)
        out = run.output_ids
        reason = "stop" if out and out[-1] in stops else "length"
        stop_reason = out[-1] if reason == "stop" and out[-1] in set(body.get("stop_token_ids") or []) else None
        choice: dict[str, Any] = {"index": 0, "text": " ".join(map(str, out)), "logprobs": None,
                                  "finish_reason": reason, "stop_reason": stop_reason, "prompt_logprobs": None}
        if body.get("return_token_ids") and not self.ignores_return_token_ids:
            choice["token_ids"] = list(out)
            choice["prompt_token_ids"] = [1] * self.bos_first + list(prompt)
        answer = {"id": f"cmpl-{self.calls}", "object": "text_completion", "created": int(time.time()),
                  "model": self.served_name, "choices": [choice],
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                            "total_tokens": len(prompt) + len(out)}}
        k = self.num_spec_tokens
        if self.per_request and k is not None:
            # vLLM's per-request speculative metrics (PR #48915): counted before the output is cut, as the counters.
            verified = run.verified if run.verified is not None else [k] * len(run.accepted)
            hist = [0] * (k + 1)
            for a in run.accepted:
                hist[a] += 1
            steps, accepted = len(run.accepted), sum(run.accepted)
            spec = {"num_spec_steps": steps, "num_draft_tokens": sum(verified), "num_accepted_draft_tokens": accepted,
                    "num_spec_tokens": k, "acceptance_histogram": hist,
                    "mean_acceptance_length": 1 + accepted / steps if steps else 0.0,
                    "draft_acceptance_rate": accepted / sum(verified) if sum(verified) else 0.0}
            if self.per_request == "detailed":
                spec["per_step_accepted"] = list(run.accepted)
            answer["metrics"] = {"speculative_decoding": spec}
        if self.reports_timing is not None:
            answer.setdefault("metrics", {}).update(self.reports_timing)
        return 200, answer, lambda: self._count(engine, prompt, run, reason)


@contextlib.contextmanager
def serve(state: FakeVLLM) -> Iterator[str]:
    """Serve ``state`` on a free port of 127.0.0.1; yields the base URL."""

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/health":
                self.send_bytes(200, b"")
            elif url.path == "/v1/models":
                self.send_json(state.models())
            elif url.path == "/server_info" and state.dev_mode:
                self.send_json(state.server_info())
            elif url.path == "/metrics" and state.serves_metrics:
                with state.lock:
                    state.metrics_calls += 1
                    garbage = state.metrics_calls <= state.metrics_garbage_first
                if garbage:
                    self.send_bytes(200, b"<html><body>502 Bad Gateway</body></html>", ctype="text/html")
                else:
                    self.send_bytes(200, state.metrics_text().encode(), ctype="text/plain; version=0.0.4")
            else:
                self.send_json({"detail": "Not Found"}, status=404)

        def do_POST(self) -> None:
            if urlparse(self.path).path != "/v1/completions":
                self.send_json({"detail": "Not Found"}, status=404)
                return
            body = self.read_json()
            with state.lock:
                state.calls += 1
                call = state.calls
                state.bodies.append(body)
            if call <= state.fail_first or tuple(body.get("prompt") or []) in state.unavailable:
                self.send_json({"object": "error", "message": "Service Unavailable", "code": 503}, status=503)
                return
            key = tuple(body.get("prompt") or [])
            with state.lock:
                engine = state.arrivals % state.engines
                state.arrivals += 1
                state.running[engine] += 1
            try:
                if key in state.on_arrival:
                    state.on_arrival.pop(key)()
                if key in state.hold:
                    assert state.hold[key].wait(30)
                status, answer, record = state.complete(body, engine)
            finally:
                with state.lock:
                    state.running[engine] -= 1
            if state.late_stats_s:
                threading.Timer(state.late_stats_s, record).start()
            else:
                record()
            if call <= state.fail_first + state.drop_first:
                self.close_connection = True  # the request ran; its answer never comes
                self.connection.shutdown(2)
                return
            if call <= state.fail_first + state.drop_first + state.garbage_first:
                self.send_bytes(200, json.dumps(answer).encode()[:40])
                return
            self.send_json(answer, status=status)

    with serve_http(Handler) as url:
        yield url


_lock = threading.Lock()
# Per model, its greedy continuations already generated: the tests send the same prompts to many servers.
_greedy: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[tuple[int, ...], int], list[int]]] = \
    weakref.WeakKeyDictionary()


def simulated_drafts(model: torch.nn.Module, num_spec_tokens: int, miss: Callable[[int], bool]) -> Loop:
    """A greedy target with a stand-in drafter: at absolute position t the drafter proposes the target's own
    token unless ``miss(t)``. The target's tokens past the cut are generated too, so a round's accepted
    drafts are counted before the cut, as vLLM counts them. Each prompt's continuation is generated once per
    model (greedy decoding is deterministic)."""

    def greedy(prompt: list[int], n: int) -> list[int]:
        with _lock, torch.no_grad():
            done = _greedy.setdefault(model, {})
            if (tuple(prompt), n) not in done:
                out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                     pad_token_id=0)
                done[tuple(prompt), n] = out[0, len(prompt):].tolist()
        return list(done[tuple(prompt), n])

    def loop(prompt: list[int], max_tokens: int, stops: set[int]) -> Run:
        full = greedy(prompt, max_tokens + num_spec_tokens + 1)
        cut = next((i + 1 for i, t in enumerate(full[:max_tokens]) if t in stops), max_tokens)
        out, accepted = full[:cut], []
        i = 0  # out[i] is the last verified token (out[0] from the prefill)
        while i + 1 < len(out):
            a = 0
            while a < num_spec_tokens and not miss(len(prompt) + i + 1 + a):
                a += 1  # the draft at i + 1 + a is the target's token there
            accepted.append(a)
            i += a + 1
        return Run(out, accepted)

    return loop
