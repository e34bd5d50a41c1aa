"""What every served completion source shares: retries, the whole-answer deadline, whole-completion
checks and concurrent requests. ``sglang_client.SGLangClient`` and ``vllm_client.VLLMClient`` add their
server's endpoints on top (one interface, two implementations).

Prompts are sent as token ids, never text, so the served greedy completion is token-exact with what
the offline replay sees. Transient failures (connection errors, timeouts, 5xx, 429, garbled answers)
are retried with capped exponential backoff; a completion that was cut short is an error, never a
silently shorter sample.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import requests

from ..common.errors import DFlashCBError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class ServerError(DFlashCBError, RuntimeError):
    """A serving engine could not give a usable answer."""


class RetryableAnswer(Exception):
    """An answer worth another attempt (a malformed or incomplete one); never leaves a client."""


@dataclass
class Completion:
    output_ids: list[int]  # the completion only, the prompt not included
    finish_reason: str  # "stop" | "length"
    # SGLang: the answer's meta_info; vLLM: the request's served counters (vllm_counters.request_counters)
    meta_info: dict[str, Any] = field(default_factory=dict)
    # The answered attempt's wall time at the client, from sending the request to the whole answer.
    wall_seconds: float | None = None
    # What the server says of the request's time, where it says anything (``served_speed.SERVER_TIMING``).
    server_timing: dict[str, float] = field(default_factory=dict)


def server_root(url: str) -> str:
    """The server's base URL from what a user types: ``http://`` added when no scheme is given, a trailing
    ``/`` and an OpenAI-style ``/v1`` left out (the clients add the paths themselves)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def answers(session: Any, url: str, timeout: float = 5.0) -> Any:
    """The JSON a ``GET url`` answers with 200, else None (one attempt: a probe of what a server is)."""
    try:
        r = session.get(url, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


class CompletionClient:
    """Blocking client for one server; safe to share between threads. Subclasses give ``name`` (in
    messages), ``url_option`` (the option that points at the server), ``error`` (their error type)
    and the endpoints: ``health``, ``model_info``, ``speculative_config``, ``sampling_params``,
    ``generate``."""

    name = "server"
    url_option = "--url"
    error: type[ServerError] = ServerError

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
        self.url = server_root(url)
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

    def _retrying(self, attempt: Callable[[list[requests.Response]], T], label: str,
                  cancel: threading.Event | None = None) -> T:
        """Run ``attempt`` until it returns, retrying what is transient (``RetryableAnswer``, timeouts,
        dropped connections). ``attempt`` appends the response it got to the list it is given (for a
        429's Retry-After)."""
        attempts = self.max_retries + 1
        last_error = "no attempt made"
        for i in range(attempts):
            if cancel is not None and cancel.is_set():
                raise self.error(f"{label} cancelled because another request failed")
            responses: list[requests.Response] = []
            try:
                return attempt(responses)
            except requests.Timeout as exc:
                last_error = f"timed out after {self.timeout:g}s ({type(exc).__name__}: {exc})"
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                # ChunkedEncodingError: the connection dropped mid-answer.
                last_error = f"connection error: {exc}"
            except RetryableAnswer as exc:
                last_error = str(exc)
            if i + 1 < attempts:
                delay = self._delay(i, responses[-1] if responses else None)
                if cancel is not None:
                    if cancel.wait(delay):
                        raise self.error(f"{label} cancelled because another request failed")
                else:
                    time.sleep(delay)
        raise self.error(
            f"{label} failed after {attempts} attempt(s) (1 + {self.max_retries} retries, "
            f"backoff {self.backoff:g}s doubling up to {self.max_backoff:g}s); last error: {last_error}"
        )

    def _once(self, method: str, path: str, parse: Callable[[Any], T], payload: dict[str, Any] | None = None,
              responses: list[requests.Response] | None = None, raw: bool = False) -> T:
        """One attempt: ``parse`` turns the decoded JSON (the text, with ``raw``) into the result.

        ``parse`` raises RetryableAnswer for a malformed answer and ``self.error`` for a fatal one.
        """
        endpoint = f"{self.url}{path}"
        start = time.monotonic()
        deadline = start + self.timeout
        response = self.session.request(method, endpoint, json=payload, timeout=self.timeout, stream=True)
        if responses is not None:
            responses.append(response)
        data = self._read_body(response, deadline)
        text = data.decode("utf-8", errors="replace")
        status = response.status_code
        if status == 429 or status >= 500:
            raise RetryableAnswer(f"HTTP {status}: {text[:200]!r}")
        if status >= 400:
            raise self.error(
                f"{method} {endpoint} was rejected with HTTP {status}: {text[:500]!r}; "
                "this is not retried, check the request (token ids within the vocabulary, "
                "prompt + max_new_tokens within the served context length)"
            )
        if raw:
            return parse(text)
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise RetryableAnswer(f"invalid JSON in the answer ({exc}): {text[:200]!r}") from None
        result = parse(body)
        if isinstance(result, Completion):
            result.wall_seconds = time.monotonic() - start
        return result

    def _request(self, method: str, path: str, parse: Callable[[Any], T], payload: dict[str, Any] | None = None,
                 cancel: threading.Event | None = None, raw: bool = False) -> T:
        """Send one request with retries (``_once`` per attempt)."""
        return self._retrying(lambda responses: self._once(method, path, parse, payload, responses, raw),
                              f"{method} {self.url}{path}", cancel)

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

    def _health(self, path: str) -> None:
        """Raise ``self.error`` unless ``GET path`` answers 2xx (one attempt, short timeout)."""
        endpoint = f"{self.url}{path}"
        fix = f"start the server or pass {self.url_option}"
        try:
            response = self.session.get(endpoint, timeout=min(self.timeout, 10.0))
        except requests.RequestException as exc:
            raise self.error(f"{self.name} server at {self.url} is not reachable ({exc}); {fix}") from None
        if not response.ok:
            raise self.error(
                f"{self.name} server at {self.url} is not healthy: GET {path} answered HTTP "
                f"{response.status_code} {response.text[:200]!r}; {fix}"
            )

    # -- the interface ------------------------------------------------------------------------

    def health(self) -> None:
        raise NotImplementedError

    def model_info(self) -> dict[str, Any]:
        """The served model, with (some of) ``model_path``, ``served_model_name``, ``tokenizer_path``."""
        raise NotImplementedError

    def speculative_config(self) -> dict[str, Any] | None:
        """The server's speculative configuration for the manifest (``Manifest.served_spec_config``)."""
        raise NotImplementedError

    def sampling_params(self, max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
        """What a greedy request asks for (recorded in the manifest and hashed in the journal's key)."""
        raise NotImplementedError

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int], *,
                 cancel: threading.Event | None = None, vocab_size: int | None = None,
                 concurrency: int = 1) -> Completion:
        """Greedy completion of ``input_ids``; ``concurrency``: how many requests the caller keeps in flight."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------

    def whole_completion(self, endpoint: str, output_ids: Any, finish_reason: Any, max_new_tokens: int,
                         stop_token_ids: Sequence[int], vocab_size: int | None, fix: str) -> list[int]:
        """``output_ids`` when they are a whole completion: token ids (in ``[0, vocab_size)``), at most
        ``max_new_tokens``, ending on a stop token or exactly ``max_new_tokens`` long. Anything else is
        a server fault (RetryableAnswer; ``self.error`` for more tokens than asked: ``fix`` says how)."""
        where = endpoint.rsplit(" ", 1)[-1].removeprefix(self.url)
        if not isinstance(output_ids, list):
            raise RetryableAnswer(f"{where} answer has no list of token ids (got {type(output_ids).__name__}); {fix}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in output_ids):
            raise RetryableAnswer(f"{where} token ids hold non-token values: {output_ids[:10]!r}")
        if len(output_ids) > max_new_tokens:
            raise self.error(f"{endpoint} returned {len(output_ids)} tokens for max_new_tokens={max_new_tokens}; "
                             f"the server may be echoing the prompt; {fix}")
        if vocab_size is not None:
            bad = [t for t in output_ids if t >= vocab_size]
            if bad:
                raise RetryableAnswer(f"{where} returned token ids {bad[:5]} outside the target's vocabulary "
                                      f"[0, {vocab_size}): does the server serve the target?")
        stops = {int(t) for t in stop_token_ids}
        if len(output_ids) != max_new_tokens and not (output_ids and output_ids[-1] in stops):
            # e.g. finish_reason "length" after 3 of 32 tokens: a truncated answer, not a sample
            raise RetryableAnswer(
                f"{where} returned {len(output_ids)} tokens (finish_reason {finish_reason!r}) for "
                f"max_new_tokens={max_new_tokens}, neither ending on a stop token {sorted(stops)} nor "
                "max_new_tokens long: an incomplete completion"
            )
        return list(output_ids)

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
        On the first failure the rest are cancelled and ``self.error`` names the failed key.
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
        pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix=self.name.lower())
        try:
            futures: dict[Future[Completion], K] = {
                pool.submit(self.generate, ids, max_new_tokens, stop_token_ids, cancel=cancel,
                            vocab_size=vocab_size, concurrency=max_in_flight): key
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
                    raise self.error(f"request {futures[failed]!r} failed: {exc}") from exc
        finally:
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
        return {k: results[k] for k in keys}


def _model_basename(name: str) -> str:
    # "Qwen/Qwen3.6-27B", "/models/qwen3.6-27b/" and "Qwen3.6-27B" all name the same model.
    return os.path.basename(name.replace("\\", "/").rstrip("/")).lower()


def served_model_mismatch(model_info: dict[str, Any], target: str, server: str = "SGLang",
                          url_option: str = "--sglang-url") -> str | None:
    """A warning when the served model does not look like ``target`` (hub id or local folder), else None."""
    want = _model_basename(str(target))
    names = [
        str(model_info[k])
        for k in ("model_path", "served_model_name", "tokenizer_path")
        if isinstance(model_info.get(k), str) and model_info[k]
    ]
    if not names:
        return (
            f"the {server} server did not report its model ({model_info!r}); cannot check it "
            f"serves {target!r}"
        )
    if any(_model_basename(n) == want for n in names):
        return None
    return (
        f"the {server} server serves {names[0]!r}, which does not look like the target {target!r}; "
        f"reference completions from a different model give a meaningless tau; point {url_option} at a server "
        "for the target or fix --target"
    )
