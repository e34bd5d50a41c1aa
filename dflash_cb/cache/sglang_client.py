"""Thin client for SGLang's native HTTP API (``/generate``, ``/health``, ``/get_model_info``).

Prompts are sent as token ids, never text, so the served greedy completion is
token-exact with what the offline replay sees. Transient failures (connection errors,
timeouts, 5xx, 429, garbled answers) are retried with capped exponential backoff; a
completion that was cut short (``abort``) is an error, never a silently shorter sample.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import requests

from ..common.errors import DFlashCBError

K = TypeVar("K", bound=Hashable)

_FIX_DOWN = "start the server or pass --sglang-url"
_FIX_MALFORMED = (
    "upgrade SGLang to a version whose native /generate returns 'output_ids', or use --reference file"
)


class SGLangError(DFlashCBError, RuntimeError):
    """The SGLang server could not give a usable answer."""


class _Retryable(Exception):
    """A failure worth another attempt (internal)."""


@dataclass
class Completion:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    meta_info: dict[str, Any] = field(default_factory=dict)


class SGLangClient:
    """Blocking client for one SGLang server; safe to share between threads."""

    def __init__(
        self,
        url: str,
        timeout: float = 600.0,
        max_retries: int = 5,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        session: requests.Session | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._shared_session = session
        # requests.Session is not documented as thread-safe, so each worker gets its own.
        self._local = threading.local()

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def session(self) -> requests.Session:
        if self._shared_session is not None:
            return self._shared_session
        sess = getattr(self._local, "session", None)
        if sess is None:
            sess = self._local.session = requests.Session()
        return sess

    def _delay(self, attempt: int, response: requests.Response | None) -> float:
        delay = min(self.backoff * (2**attempt), self.max_backoff)
        if response is not None and response.status_code == 429:
            try:  # honour the server's Retry-After, still capped
                delay = max(delay, min(float(response.headers.get("Retry-After", "")), self.max_backoff))
            except ValueError:
                pass
        return delay

    def _request(
        self,
        method: str,
        path: str,
        parse: Callable[[Any], Any],
        payload: dict[str, Any] | None = None,
        cancel: threading.Event | None = None,
    ) -> Any:
        """Send one request with retries; ``parse`` turns the decoded JSON into the result.

        ``parse`` raises _Retryable for a malformed answer and SGLangError for a fatal one.
        """
        endpoint = f"{self.url}{path}"
        attempts = self.max_retries + 1
        last_error = "no attempt made"
        for attempt in range(attempts):
            if cancel is not None and cancel.is_set():
                raise SGLangError(f"{method} {endpoint} cancelled because another request failed")
            response: requests.Response | None = None
            try:
                deadline = time.monotonic() + self.timeout
                response = self.session.request(method, endpoint, json=payload, timeout=self.timeout, stream=True)
                data = self._read_body(response, deadline)
                text = data.decode("utf-8", errors="replace")
                status = response.status_code
                if status == 429 or status >= 500:
                    raise _Retryable(f"HTTP {status}: {text[:200]!r}")
                if status >= 400:
                    raise SGLangError(
                        f"{method} {endpoint} was rejected with HTTP {status}: {text[:500]!r}; "
                        "this is not retried, check the request (token ids within the vocabulary, "
                        "prompt + max_new_tokens within the served context length)"
                    )
                try:
                    body = json.loads(data)
                except ValueError as exc:
                    raise _Retryable(f"invalid JSON in the answer ({exc}): {text[:200]!r}") from None
                return parse(body)
            except requests.Timeout as exc:
                last_error = f"timed out after {self.timeout:g}s ({type(exc).__name__}: {exc})"
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                # ChunkedEncodingError: the connection dropped mid-answer.
                last_error = f"connection error: {exc}"
            except _Retryable as exc:
                last_error = str(exc)
            if attempt + 1 < attempts:
                delay = self._delay(attempt, response)
                if cancel is not None:
                    if cancel.wait(delay):
                        raise SGLangError(f"{method} {endpoint} cancelled because another request failed")
                else:
                    time.sleep(delay)
        raise SGLangError(
            f"{method} {endpoint} failed after {attempts} attempt(s) (1 + {self.max_retries} retries, "
            f"backoff {self.backoff:g}s doubling up to {self.max_backoff:g}s); last error: {last_error}"
        )

    def _read_body(self, response: requests.Response, deadline: float) -> bytes:
        """The whole body, or requests.Timeout once ``deadline`` passes.

        ``timeout`` in requests bounds each socket read, not the request: a server sending a
        byte every few seconds would hold a request forever. The deadline is checked between
        reads (each read is itself bounded by the timeout).
        """
        chunks = []
        try:
            read = getattr(response.raw, "read1", None) or response.raw.read
            while True:
                if time.monotonic() > deadline:
                    raise requests.Timeout(f"no complete answer within {self.timeout:g}s (server too slow)")
                chunk = read(1 << 16, decode_content=True)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        except (OSError, ValueError) as exc:  # urllib3's read errors: a dropped or timed-out connection
            if isinstance(exc, requests.RequestException):
                raise
            raise requests.ConnectionError(f"reading the answer failed: {exc}") from exc
        finally:
            response.close()

    # -- endpoints --------------------------------------------------------------------------

    def health(self) -> None:
        """Raise SGLangError unless ``GET /health`` answers 2xx (one attempt, short timeout)."""
        endpoint = f"{self.url}/health"
        try:
            response = self.session.get(endpoint, timeout=min(self.timeout, 10.0))
        except requests.RequestException as exc:
            raise SGLangError(f"SGLang server at {self.url} is not reachable ({exc}); {_FIX_DOWN}") from None
        if not response.ok:
            raise SGLangError(
                f"SGLang server at {self.url} is not healthy: GET /health answered HTTP "
                f"{response.status_code} {response.text[:200]!r}; {_FIX_DOWN}"
            )

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``, e.g. ``{"model_path": "Qwen/Qwen3.6-27B", ...}``."""

        def parse(body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                raise _Retryable(f"/get_model_info answered {type(body).__name__}, expected an object")
            return body

        return self._request("GET", "/get_model_info", parse)

    def server_info(self) -> dict[str, Any]:
        """``GET /get_server_info`` (the server's arguments, e.g. ``speculative_algorithm``); ``{}`` if absent.

        Only describes the server in the manifest, so a server without the endpoint is not an error.
        Transient failures are retried like every request: the answer is part of the cache's
        identity, and a resumed run must see the same one.
        """

        def parse(body: Any) -> dict[str, Any]:
            return body if isinstance(body, dict) else {}

        try:
            return self._request("GET", "/get_server_info", parse)
        except SGLangError:  # HTTP 404 on an older server, or nothing usable after the retries
            return {}

    def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_token_ids: list[int],
        *,
        cancel: threading.Event | None = None,
        vocab_size: int | None = None,
    ) -> Completion:
        """Greedy completion of ``input_ids``; output_ids hold the completion only (no prompt).

        A completion is accepted only when it is whole: it ends on a stop token or has exactly
        ``max_new_tokens`` tokens, and (given ``vocab_size``) every id is in the vocabulary.
        Anything else is a server fault, retried like one, then an SGLangError.
        """
        payload = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": int(max_new_tokens),
                "stop_token_ids": [int(t) for t in stop_token_ids],
                "skip_special_tokens": False,
            },
        }
        endpoint = f"{self.url}/generate"

        def parse(body: Any) -> Completion:
            if isinstance(body, list) and len(body) == 1:
                body = body[0]  # some versions wrap a single answer in a batch list
            if not isinstance(body, dict):
                raise _Retryable(f"/generate answered {type(body).__name__}, expected an object")
            output_ids = body.get("output_ids")
            if not isinstance(output_ids, list):
                raise _Retryable(
                    f"/generate answer has no list 'output_ids' (got {type(output_ids).__name__}); "
                    f"{_FIX_MALFORMED}"
                )
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in output_ids):
                raise _Retryable(f"/generate 'output_ids' holds non-token values: {output_ids[:10]!r}")
            meta = body.get("meta_info")
            if not isinstance(meta, dict):
                raise _Retryable(f"/generate answer has no 'meta_info' object; {_FIX_MALFORMED}")
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind == "abort":
                message = reason.get("message") if isinstance(reason, dict) else None
                raise SGLangError(
                    f"POST {endpoint} aborted the request (finish_reason {reason!r}, message: {message!r}); "
                    "the sample would be silently shortened, so it is rejected; check the server log "
                    "(out of memory, request too long for the served context?)"
                )
            if kind not in ("stop", "length"):
                raise _Retryable(f"/generate answer has unexpected finish_reason {reason!r}")
            if len(output_ids) > max_new_tokens:
                raise SGLangError(
                    f"POST {endpoint} returned {len(output_ids)} tokens for max_new_tokens={max_new_tokens}; "
                    "the server may be echoing the prompt in output_ids; "
                    f"{_FIX_MALFORMED}"
                )
            if vocab_size is not None:
                bad = [t for t in output_ids if t >= vocab_size]
                if bad:
                    raise _Retryable(f"/generate returned token ids {bad[:5]} outside the target's vocabulary "
                                     f"[0, {vocab_size}): does the server serve the target?")
            stops = {int(t) for t in stop_token_ids}
            if len(output_ids) != max_new_tokens and not (output_ids and output_ids[-1] in stops):
                # e.g. finish_reason "length" after 3 of 32 tokens: a truncated answer, not a sample
                raise _Retryable(
                    f"/generate returned {len(output_ids)} tokens (finish_reason {reason!r}) for "
                    f"max_new_tokens={max_new_tokens}, neither ending on a stop token {sorted(stops)} nor "
                    "max_new_tokens long: an incomplete completion"
                )
            return Completion(output_ids=list(output_ids), finish_reason=kind, meta_info=meta)

        return self._request("POST", "/generate", parse, payload=payload, cancel=cancel)

    def generate_many(
        self,
        requests: Iterable[tuple[K, list[int]]],
        max_new_tokens: int,
        stop_token_ids: list[int],
        max_in_flight: int = 8,
        on_result: Callable[[K, Completion], None] | None = None,
        vocab_size: int | None = None,
    ) -> dict[K, Completion]:
        """Run many greedy completions with up to ``max_in_flight`` requests at the server.

        Results come back keyed like the requests, in request order. ``on_result`` is called
        from this thread as each completion arrives (so it may write files without locks): a
        caller that journals there loses nothing to a kill.
        On the first failure the rest are cancelled and SGLangError names the failed key.
        """
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        items = list(requests)
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            dup = next(k for i, k in enumerate(keys) if k in keys[:i])
            raise ValueError(f"generate_many: duplicate request key {dup!r}")
        results: dict[K, Completion] = {}
        cancel = threading.Event()
        pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="sglang")
        try:
            futures: dict[Future[Completion], K] = {
                pool.submit(self.generate, ids, max_new_tokens, stop_token_ids, cancel=cancel,
                            vocab_size=vocab_size): key
                for key, ids in items
            }
            order = {k: i for i, k in enumerate(keys)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                # Hand over every completion that did arrive before raising for a failed one, in
                # request order: a caller that journals results loses none of them.
                finished = sorted(done, key=lambda f: order[futures[f]])
                for fut in finished:
                    if fut.exception() is None:
                        key = futures[fut]
                        results[key] = fut.result()
                        if on_result is not None:
                            on_result(key, results[key])
                failed = next((f for f in finished if f.exception() is not None), None)
                if failed is not None:
                    cancel.set()
                    for other in pending:
                        other.cancel()
                    exc = failed.exception()
                    raise SGLangError(f"request {futures[failed]!r} failed: {exc}") from exc
        finally:
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
        return {k: results[k] for k in keys}


def _model_basename(name: str) -> str:
    # "Qwen/Qwen3.6-27B", "/models/qwen3.6-27b/" and "Qwen3.6-27B" all name the same model.
    return os.path.basename(name.replace("\\", "/").rstrip("/")).lower()


def served_model_mismatch(model_info: dict[str, Any], target: str) -> str | None:
    """A warning when the served model does not look like ``target`` (hub id or local folder), else None."""
    want = _model_basename(str(target))
    names = [
        str(model_info[k])
        for k in ("model_path", "served_model_name", "tokenizer_path")
        if isinstance(model_info.get(k), str) and model_info[k]
    ]
    if not names:
        return (
            f"the SGLang server did not report its model (get_model_info: {model_info!r}); cannot check it "
            f"serves {target!r}"
        )
    if any(_model_basename(n) == want for n in names):
        return None
    return (
        f"the SGLang server serves {names[0]!r}, which does not look like the target {target!r}; "
        "reference completions from a different model give a meaningless tau; point --sglang-url at a server "
        "for the target or fix --target"
    )
