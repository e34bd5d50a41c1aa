"""SGLangClient against a real HTTP server that speaks SGLang's native API.

The server's /generate is backed by a tiny random Qwen3 model's greedy output, so the
tests check token-exact round trips, not canned answers. Faults are injected per test.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
import torch
from local_http import JSONHandler, serve
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_cb.cache.sglang_client import Completion, SGLangClient, SGLangError, served_model_mismatch

MODEL_PATH = "/models/Qwen/Qwen3-Tiny-Test"


@pytest.fixture(scope="module")
def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen3ForCausalLM(config).eval()


_model_lock = threading.Lock()


def greedy(model: Qwen3ForCausalLM, input_ids: list[int], max_new_tokens: int, stop: list[int]) -> list[int]:
    """Reference greedy completion (prompt stripped), the same way the fake server computes it."""
    with _model_lock, torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]),
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            # An empty stop list must not fall back to the config's eos id.
            eos_token_id=stop if stop else None,
            pad_token_id=0,
        )
    return out[0, len(input_ids) :].tolist()


class FakeSGLang:
    """State and fault knobs of one fake server."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.generate_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict[str, Any]] = []
        # fault knobs
        self.fail_first = 0  # answer this many /generate calls with 503
        self.fail_status = 503
        self.stall_first = 0  # hold this many first calls `stall_s` seconds, or until `release` is set
        self.stall_s = 0.0
        self.release = threading.Event()
        self.malformed_first = 0  # this many invalid-JSON answers
        self.malformed_forever = False
        self.missing_output_ids = False
        self.abort = False
        self.reject_status: int | None = None  # e.g. 400
        self.reject_token: int | None = None  # reject (400) only prompts holding this token
        self.delay_s = 0.0  # per-request sleep, to make concurrency visible
        self.health_status = 200
        self.trickle_s = 0.0  # send the answer's body one byte every trickle_s seconds
        self.trickled: list[int] = []  # per trickled answer: [bytes sent, bytes in the answer]
        self.short_first = 0  # this many answers cut to 3 tokens, still claiming finish_reason "length"
        self.oov = False  # answers holding a token id outside the 128-token vocabulary

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body["sampling_params"]
        ids = body["input_ids"]
        n = params["max_new_tokens"]
        stop = params.get("stop_token_ids") or []
        out = greedy(self.model, ids, n, stop)
        finish = (
            {"type": "stop", "matched": out[-1]}
            if out and out[-1] in stop
            else {"type": "length", "length": n}
        )
        return {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "id": "req",
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
            },
        }


def make_handler(state: FakeSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(JSONHandler):
        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_bytes(status, body, ctype)

        def _json(self, status: int, obj: Any) -> None:
            if state.trickle_s and status == 200:
                body = json.dumps(obj).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    state.trickled = [0, len(body)]
                    for i in range(len(body)):
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        state.trickled[0] += 1
                        time.sleep(state.trickle_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return
            self._send(status, json.dumps(obj).encode())

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(state.health_status, b"")
            elif self.path == "/get_model_info":
                self._json(
                    200, {"model_path": MODEL_PATH, "tokenizer_path": MODEL_PATH, "is_generation": True}
                )
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            if self.path != "/generate":
                self._json(404, {"error": "not found"})
                return
            with state.lock:
                state.generate_calls += 1
                call = state.generate_calls
                state.requests.append(body)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if state.delay_s:
                    time.sleep(state.delay_s)
                if call <= state.stall_first:
                    state.release.wait(state.stall_s)
                if state.reject_status is not None or state.reject_token in body["input_ids"]:
                    self._json(
                        state.reject_status or 400, {"error": "bad request: input_ids out of vocabulary"}
                    )
                elif call <= state.fail_first:
                    self._json(state.fail_status, {"error": "server busy"})
                elif state.malformed_forever or call <= state.malformed_first:
                    self._send(200, b'{"text": "", "output_ids": [1, 2')
                elif state.missing_output_ids:
                    self._json(200, {"text": "abc", "meta_info": {"finish_reason": {"type": "length"}}})
                elif state.abort:
                    self._json(
                        200,
                        {
                            "text": "",
                            "output_ids": [5],
                            "meta_info": {
                                "finish_reason": {"type": "abort", "message": "KV cache out of memory"}
                            },
                        },
                    )
                else:
                    answer = state.complete(body)
                    if call <= state.short_first:
                        answer["output_ids"] = answer["output_ids"][:3]
                    if state.oov:
                        answer["output_ids"][-1] = 1000
                    self._json(200, answer)
            finally:
                with state.lock:
                    state.in_flight -= 1

    return Handler


@pytest.fixture
def server(tiny_model: Qwen3ForCausalLM) -> Iterator[tuple[str, FakeSGLang]]:
    state = FakeSGLang(tiny_model)
    with serve(make_handler(state)) as url:
        yield url, state


def fast_client(url: str, **kw: Any) -> SGLangClient:
    kw = {"timeout": 5.0, "max_retries": 3, "backoff": 0.01, "max_backoff": 0.05, **kw}
    return SGLangClient(url, **kw)


PROMPT = [1, 17, 42, 99, 5, 64]


def test_generate_matches_model_greedy(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, state = server
    comp = fast_client(url).generate(PROMPT, 12, [])
    assert isinstance(comp, Completion)
    assert comp.output_ids == greedy(tiny_model, PROMPT, 12, [])
    assert len(comp.output_ids) == 12
    assert comp.finish_reason == "length"
    assert comp.meta_info["prompt_tokens"] == len(PROMPT)
    # The wire format is SGLang's: token ids in, greedy, special tokens kept.
    sent = state.requests[0]
    assert sent["input_ids"] == PROMPT
    assert sent["sampling_params"] == {
        "temperature": 0,
        "max_new_tokens": 12,
        "stop_token_ids": [],
        "skip_special_tokens": False,
    }


def test_generate_stop_token(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, _ = server
    free = greedy(tiny_model, PROMPT, 12, [])
    stop_tok = free[3]
    expected = greedy(tiny_model, PROMPT, 12, [stop_tok])
    comp = fast_client(url).generate(PROMPT, 12, [stop_tok])
    assert comp.output_ids == expected
    assert comp.output_ids[-1] == stop_tok and len(comp.output_ids) <= 4
    assert comp.finish_reason == "stop"


def test_retries_5xx_then_succeeds(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, state = server
    state.fail_first = 2
    comp = fast_client(url).generate(PROMPT, 8, [])
    assert comp.output_ids == greedy(tiny_model, PROMPT, 8, [])
    assert state.generate_calls == 3


def test_retries_429(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, state = server
    state.fail_first, state.fail_status = 1, 429
    comp = fast_client(url).generate(PROMPT, 8, [])
    assert comp.output_ids == greedy(tiny_model, PROMPT, 8, [])
    assert state.generate_calls == 2


def test_retries_after_stalled_request(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, state = server
    state.stall_first, state.stall_s = 1, 60.0
    comp = fast_client(url, timeout=0.3).generate(PROMPT, 8, [])
    assert comp.output_ids == greedy(tiny_model, PROMPT, 8, [])
    assert state.generate_calls == 2
    assert state.in_flight == 1  # did not wait for the stalled answer: it is still held
    state.release.set()


def test_retries_malformed_json_once(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, state = server
    state.malformed_first = 1
    comp = fast_client(url).generate(PROMPT, 8, [])
    assert comp.output_ids == greedy(tiny_model, PROMPT, 8, [])
    assert state.generate_calls == 2


def test_malformed_forever_raises_after_max_retries(server: tuple[str, FakeSGLang]) -> None:
    url, state = server
    state.malformed_forever = True
    with pytest.raises(SGLangError) as info:
        fast_client(url, max_retries=3).generate(PROMPT, 8, [])
    msg = str(info.value)
    assert "/generate" in msg and "4 attempt" in msg and "invalid JSON" in msg
    assert state.generate_calls == 4


def test_missing_output_ids_says_how_to_fix(server: tuple[str, FakeSGLang]) -> None:
    url, state = server
    state.missing_output_ids = True
    with pytest.raises(SGLangError, match="output_ids") as info:
        fast_client(url, max_retries=1).generate(PROMPT, 8, [])
    assert "--reference file" in str(info.value)
    assert state.generate_calls == 2


def test_abort_is_an_error(server: tuple[str, FakeSGLang]) -> None:
    url, state = server
    state.abort = True
    with pytest.raises(SGLangError, match="KV cache out of memory"):
        fast_client(url).generate(PROMPT, 8, [])
    assert state.generate_calls == 1


def test_400_is_not_retried(server: tuple[str, FakeSGLang]) -> None:
    url, state = server
    state.reject_status = 400
    with pytest.raises(SGLangError, match="HTTP 400"):
        fast_client(url, max_retries=5).generate(PROMPT, 8, [])
    assert state.generate_calls == 1


def test_health(server: tuple[str, FakeSGLang]) -> None:
    url, state = server
    fast_client(url).health()
    state.health_status = 503
    with pytest.raises(SGLangError, match="--sglang-url"):
        fast_client(url).health()


def test_health_fails_when_server_down() -> None:
    with socket.socket() as sock:  # grab a free port, then close it so nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(SGLangError) as info:
        fast_client(url).health()
    assert url in str(info.value) and "start the server or pass --sglang-url" in str(info.value)
    with pytest.raises(SGLangError, match="connection error"):
        fast_client(url, max_retries=1).generate(PROMPT, 4, [])


def test_model_info_and_mismatch(server: tuple[str, FakeSGLang]) -> None:
    url, _ = server
    info = fast_client(url).model_info()
    assert info["model_path"] == MODEL_PATH
    assert served_model_mismatch(info, "Qwen/Qwen3-Tiny-Test") is None
    assert served_model_mismatch(info, "/data/ckpt/qwen3-tiny-test/") is None
    assert served_model_mismatch(info, "qwen3-tiny-test") is None
    warning = served_model_mismatch(info, "Qwen/Qwen3.6-27B")
    assert warning is not None and "Qwen3.6-27B" in warning and MODEL_PATH in warning
    assert served_model_mismatch({}, "Qwen/Qwen3.6-27B") is not None


def test_generate_many_concurrent(server: tuple[str, FakeSGLang], tiny_model: Qwen3ForCausalLM) -> None:
    url, state = server
    state.delay_s = 0.15
    prompts = {f"p{i}": [1, 3 + i, 40 + 2 * i, 7, 90 - i] for i in range(8)}
    seen: list[str] = []
    results = fast_client(url).generate_many(
        prompts.items(), 10, [], max_in_flight=4, on_result=lambda k, c: seen.append(k)
    )
    assert list(results) == list(prompts)  # request order
    assert sorted(seen) == sorted(prompts)
    for key, ids in prompts.items():
        assert results[key].output_ids == greedy(tiny_model, ids, 10, [])
    assert 2 <= state.max_in_flight <= 4


def test_generate_many_failure_names_key(server: tuple[str, FakeSGLang]) -> None:
    url, state = server
    state.reject_token = 127
    reqs = [("bad", [1, 127, 3])] + [(f"ok{i}", [1, 5 + i, 3]) for i in range(6)]
    with pytest.raises(SGLangError, match=r"request 'bad' failed.*HTTP 400"):
        fast_client(url).generate_many(reqs, 4, [], max_in_flight=1)
    # The rest were cancelled: at most the one a worker had already picked up was sent.
    assert state.generate_calls <= 2


def test_short_length_answer_is_retried_then_refused(server: tuple[str, FakeSGLang], tiny_model) -> None:
    """3 tokens with finish_reason "length" for max_new_tokens=12 is not a completion."""
    url, state = server
    state.short_first = 1
    comp = fast_client(url).generate(PROMPT, 12, [])
    assert comp.output_ids == greedy(tiny_model, PROMPT, 12, []) and state.generate_calls == 2
    state.short_first = 100
    with pytest.raises(SGLangError, match=r"returned 3 tokens .* an incomplete completion"):
        fast_client(url, max_retries=2).generate(PROMPT, 12, [])
    assert state.generate_calls == 2 + 3


def test_out_of_vocabulary_ids_are_refused(server: tuple[str, FakeSGLang]) -> None:
    """Ids the target cannot have produced are a server fault, not a completion."""
    url, state = server
    state.oov = True
    with pytest.raises(SGLangError, match=r"token ids \[1000\] outside the target's vocabulary \[0, 128\)"):
        fast_client(url, max_retries=1).generate(PROMPT, 8, [], vocab_size=128)
    seen: list[str] = []
    with pytest.raises(SGLangError, match="request 'a' failed"):
        fast_client(url, max_retries=0).generate_many([("a", PROMPT)], 8, [], on_result=lambda k, c: seen.append(k),
                                                      vocab_size=128)
    assert seen == []  # nothing handed over for journaling


def test_timeout_is_per_request_not_per_read(server: tuple[str, FakeSGLang]) -> None:
    """A server trickling a byte every 0.08 s (each read well within the timeout) cannot hold a request past it."""
    url, state = server
    state.trickle_s = 0.08  # the ~200-byte answer would take ~16 s
    with pytest.raises(SGLangError, match=r"no complete answer within 0\.4s"):
        fast_client(url, timeout=0.4, max_retries=0).generate(PROMPT, 8, [])
    sent, size = state.trickled
    assert size > 150 and sent < size // 2  # it gave up with most of the answer still to come
