"""Client for vLLM's OpenAI-compatible server: ``/v1/completions``, ``/v1/models``, ``/metrics``, ``/health``.

Greedy completions are asked with the prompt as token ids and ``return_token_ids``, so the completion
comes back as ids (the choice's ``token_ids``) and the prompt the server used beside it
(``prompt_token_ids``, checked against ours). ``ignore_eos`` with the stop ids given explicitly makes the
stop set exactly ``--stop-token-ids`` (vLLM would otherwise stop at its tokenizer's EOS as well).

A vLLM started with ``--per-request-spec-decode-metrics summary|detailed`` reports speculation in each answer
(``body["metrics"]["speculative_decoding"]``): the client keeps those (``vllm_counters.answer_counters``), at any number
of requests in flight and with other clients on the server, and reads no ``/metrics``. Older servers report
only server-wide counters: at one request in flight the client reads ``/metrics`` before and after each attempt
and keeps the change across it (``vllm_counters.request_counters``: the request's own only when it ran alone),
waiting up to ``SETTLE_S`` for the server to count the request. Retries, the
whole-answer deadline and the whole-completion checks are shared with the SGLang client
(``completion_client``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import requests

from . import vllm_counters as V
from .completion_client import Completion, CompletionClient, RetryableAnswer, ServerError, answers
from .completion_client import served_model_mismatch as _mismatch

logger = logging.getLogger(__name__)

_FIX_MALFORMED = ("use a vLLM whose /v1/completions honours return_token_ids (the choice's 'token_ids'), "
                  "or use --reference file")
# After an answer, how long to wait for the server's statistics to count it (vLLM records them as it
# hands the last step's output over, so normally at once); then the counters are read as they are.
SETTLE_S = 5.0
_SETTLE_POLL_S = 0.02


class VLLMError(ServerError):
    """The vLLM server could not give a usable answer."""


class VLLMClient(CompletionClient):
    """Blocking client for one vLLM server; safe to share between threads."""

    name = "vLLM"
    url_option = "--vllm-url"
    error = VLLMError

    def __init__(self, url: str, timeout: float = 600.0, max_retries: int = 5, backoff: float = 1.0,
                 max_backoff: float = 30.0, session: requests.Session | None = None,
                 settle_s: float = SETTLE_S) -> None:
        super().__init__(url, timeout, max_retries, backoff, max_backoff, session)
        self.settle_s = settle_s
        self._model: dict[str, Any] | None = None
        self._warned_no_counters = False
        self._speculates: bool | None = None
        self._per_request = False  # the answers carry their own speculative metrics
        self._no_metrics: str | None = None  # why /metrics cannot be read, once found

    def health(self) -> None:
        """Raise VLLMError unless ``GET /health`` answers 2xx (one attempt, short timeout)."""
        self._health("/health")

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the served models' cards (``id``, ``root``, ``parent``, ``max_model_len``)."""

        def parse(body: Any) -> list[dict[str, Any]]:
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list) or not data or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                                  for m in data):
                raise RetryableAnswer(f"/v1/models answered {str(body)[:200]!r}, expected {{'data': [{{'id': ...}}]}}")
            return data

        return self._request("GET", "/v1/models", parse)

    def model_info(self) -> dict[str, Any]:
        """The base model (a card without ``parent``; LoRA adapters have one) in the names the manifest and
        the journal key use: ``served_model_name`` (its ``id``), ``model_path`` (its ``root``),
        ``max_model_len``. The cards' timestamps are left out: the manifest must not change between runs."""
        if self._model is None:
            sglang = answers(self.session, f"{self.url}/get_model_info")
            if isinstance(sglang, dict) and "model_path" in sglang:  # vLLM serves no such endpoint
                raise VLLMError(f"{self.url} is an SGLang server (it answers /get_model_info): use --reference "
                                f"sglang --sglang-url {self.url}")
            cards = self.models()
            card = next((m for m in cards if not m.get("parent")), cards[0])
            info: dict[str, Any] = {"served_model_name": card["id"]}
            if isinstance(card.get("root"), str):
                info["model_path"] = card["root"]
            if isinstance(card.get("max_model_len"), int):
                info["max_model_len"] = card["max_model_len"]
            self._model = info
        return dict(self._model)

    def metrics(self, cancel: threading.Event | None = None) -> V.Snapshot:
        """``GET /metrics`` read into the counters the precompute keeps (retried like every request; an
        answer that is not the Prometheus text format is retried, then a VLLMError)."""

        def parse(text: str) -> V.Snapshot:
            try:
                return V.snapshot(text)
            except ValueError as exc:
                raise RetryableAnswer(f"/metrics is not Prometheus text ({exc})") from None

        return self._request("GET", "/metrics", parse, cancel=cancel, raw=True)

    def server_info(self) -> dict[str, Any]:
        """``GET /server_info?config_format=json`` (the engine's configuration; vLLM serves it only with
        ``VLLM_SERVER_DEV_MODE=1``), ``{}`` when absent."""

        def parse(body: Any) -> dict[str, Any]:
            return body if isinstance(body, dict) else {}

        try:
            return self._request("GET", "/server_info?config_format=json", parse)
        except VLLMError:
            return {}

    def speculative_config(self) -> dict[str, Any] | None:
        snap = self._metrics_if_served(None)
        if snap is not None and not snap.exports_counters:
            logger.warning(f"warning: the vLLM server at {self.url} exports no {V.REQUEST_SUCCESS} on /metrics "
                           "(started with --disable-log-stats?): no speculative counters will be recorded")
        return V.speculative_config(self.server_info(), snap)

    def sampling_params(self, max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
        # Penalties explicit: vLLM fills unset ones from the model's generation_config, and greedy
        # decoding still applies them.
        return {"temperature": 0, "max_tokens": int(max_new_tokens), "stop_token_ids": [int(t) for t in stop_token_ids],
                "ignore_eos": True, "min_tokens": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0}

    def _settled(self, before: V.Snapshot, cancel: threading.Event | None) -> V.Snapshot:
        """``/metrics`` once the server has counted one more finished request (or ``settle_s`` later)."""
        deadline = time.monotonic() + self.settle_s
        while True:
            snap = self.metrics(cancel)
            done = (snap.values.get(V.REQUEST_SUCCESS) or 0) > (before.values.get(V.REQUEST_SUCCESS) or 0)
            if done or not snap.exports_counters or time.monotonic() >= deadline:
                return snap
            time.sleep(_SETTLE_POLL_S)

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int], *,
                 cancel: threading.Event | None = None, vocab_size: int | None = None,
                 concurrency: int = 1) -> Completion:
        """Greedy completion of ``input_ids`` (the completion's ids only); ``meta_info`` holds the request's
        served counters (None-free: ``{}`` when the server exports none). At ``concurrency`` 1 every
        attempt reads ``/metrics`` before and after, so a retried request's counters are its last
        attempt's; above 1 they cannot be the request's own and are marked so."""
        prompt = [int(t) for t in input_ids]
        payload = {"model": self.model_info()["served_model_name"], "prompt": prompt,
                   **self.sampling_params(max_new_tokens, stop_token_ids),
                   "n": 1, "stream": False, "echo": False, "return_token_ids": True, "skip_special_tokens": False}
        endpoint = f"POST {self.url}/v1/completions"

        def parse(body: Any) -> Completion:
            choices = body.get("choices") if isinstance(body, dict) else None
            if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
                raise RetryableAnswer(f"/v1/completions answer has no single choice: {str(body)[:200]!r}")
            choice = choices[0]
            reason = choice.get("finish_reason")
            if reason == "abort":
                raise VLLMError(f"{endpoint} aborted the request (finish_reason 'abort'); the sample would be "
                                "silently shortened, so it is rejected; check the server log (out of memory, "
                                "request too long for max_model_len?)")
            if reason not in ("stop", "length"):
                raise RetryableAnswer(f"/v1/completions answer has unexpected finish_reason {reason!r}")
            echoed = choice.get("prompt_token_ids")
            if echoed is not None and echoed != prompt:
                raise VLLMError(f"{endpoint} completed other prompt tokens than sent ({len(echoed)} tokens, "
                                f"{len(prompt)} sent): the completion would not continue our prompt; a vLLM "
                                "that takes a token-id prompt as given is needed")
            ids = self.whole_completion(endpoint, choice.get("token_ids"), reason, max_new_tokens, stop_token_ids,
                                        vocab_size, _FIX_MALFORMED)
            usage = body.get("usage")
            done = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if isinstance(done, int) and done != len(ids):
                raise RetryableAnswer(f"/v1/completions usage says {done} completion tokens, token_ids hold {len(ids)}")
            try:
                own = V.answer_counters(body)  # the request's own, when the server reports per request
            except ValueError as e:
                raise RetryableAnswer(f"/v1/completions answer: {e}") from None
            from .served_speed import server_timing

            return Completion(output_ids=ids, finish_reason=reason, meta_info=own or {},
                              server_timing=server_timing(body, "vllm"))

        if concurrency > 1 or self._per_request:
            # Per-request metrics need no quiet server and no /metrics: any --max-in-flight, other traffic.
            completion = self._request("POST", "/v1/completions", parse, payload=payload, cancel=cancel)
            if completion.meta_info:
                self._per_request = True
            elif concurrency > 1:
                completion.meta_info = V.concurrent_counters(concurrency) if self._speculating() else {}
            return completion

        def attempt(responses: list[requests.Response]) -> Completion:
            before = self._metrics_if_served(cancel)
            completion = self._once("POST", "/v1/completions", parse, payload, responses)
            if completion.meta_info:  # per-request metrics: the counters are the answer's, nothing to settle
                self._per_request = True
                return completion
            if before is None:
                return completion
            after = self._settled(before, cancel)
            counters = V.request_counters(before, after, len(completion.output_ids))
            if counters is None and not after.exports_counters and not self._warned_no_counters:
                self._warned_no_counters = True
                logger.warning(f"warning: {self.url}/metrics exports no {V.REQUEST_SUCCESS}: the completions carry "
                               "no speculative counters")
            completion.meta_info = counters or {}
            return completion

        return self._retrying(attempt, endpoint, cancel)

    def _metrics_if_served(self, cancel: threading.Event | None) -> V.Snapshot | None:
        """``/metrics`` before a request, or None (said once) when the server serves none: then the completions
        carry counters only if the server reports them per request."""
        if self._no_metrics is not None:
            return None
        try:
            return self.metrics(cancel)
        except VLLMError as e:
            self._no_metrics = str(e)
            logger.warning(f"warning: {self.url}/metrics cannot be read ({e}): the completions carry no speculative "
                           "counters unless the server reports them per request (vllm serve "
                           "--per-request-spec-decode-metrics summary); the precompute goes on")
            return None

    def _speculating(self) -> bool:
        """Whether the server exports speculative counters (read once)."""
        if self._speculates is None:
            try:
                self._speculates = self.metrics().speculating
            except ServerError:
                self._speculates = False
        return self._speculates


def served_model_mismatch(model_info: dict[str, Any], target: str) -> str | None:
    """A warning when the vLLM server's model does not look like ``target``, else None."""
    return _mismatch(model_info, target, VLLMClient.name, VLLMClient.url_option)
