"""Client for SGLang's native HTTP API (``/generate``, ``/health``, ``/get_model_info``, ``/get_server_info``).

Retries, the whole-answer deadline and concurrency are shared with the vLLM client
(``completion_client.CompletionClient``); this module is SGLang's endpoints and answer format. A
completion that was cut short (``abort``) is an error, never a silently shorter sample.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .completion_client import Completion, CompletionClient, RetryableAnswer, ServerError, answers
from .completion_client import served_model_mismatch as _mismatch
from .served import server_spec_config

__all__ = ["Completion", "SGLangClient", "SGLangError", "served_model_mismatch"]

_FIX_MALFORMED = (
    "upgrade SGLang to a version whose native /generate returns 'output_ids', or use --reference file"
)


class SGLangError(ServerError):
    """The SGLang server could not give a usable answer."""


class SGLangClient(CompletionClient):
    """Blocking client for one SGLang server; safe to share between threads."""

    name = "SGLang"
    url_option = "--sglang-url"
    error = SGLangError

    def health(self) -> None:
        """Raise SGLangError unless ``GET /health`` answers 2xx (one attempt, short timeout)."""
        self._health("/health")

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``, e.g. ``{"model_path": "Qwen/Qwen3.6-27B", ...}``."""

        def parse(body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                raise RetryableAnswer(f"/get_model_info answered {type(body).__name__}, expected an object")
            return body

        try:
            return self._request("GET", "/get_model_info", parse)
        except SGLangError:
            cards = answers(self.session, f"{self.url}/v1/models")
            if isinstance(cards, dict) and isinstance(cards.get("data"), list) and answers(
                    self.session, f"{self.url}/get_server_info") is None:
                raise SGLangError(f"{self.url} answers /v1/models but not SGLang's /get_model_info: a vLLM server? "
                                  f"use --reference vllm --vllm-url {self.url}") from None
            raise

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

    def speculative_config(self) -> dict[str, Any] | None:
        return server_spec_config(self.server_info())  # served.py: the --served-check side

    def sampling_params(self, max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": int(max_new_tokens), "stop_token_ids": [int(t) for t in stop_token_ids]}

    def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_token_ids: list[int],
        *,
        cancel: threading.Event | None = None,
        vocab_size: int | None = None,
        concurrency: int = 1,
    ) -> Completion:
        """Greedy completion of ``input_ids``; output_ids hold the completion only (no prompt).

        A completion is accepted only when it is whole (``whole_completion``). Anything else is a
        server fault, retried like one, then an SGLangError.
        """
        payload = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": {**self.sampling_params(max_new_tokens, stop_token_ids), "skip_special_tokens": False},
        }
        endpoint = f"POST {self.url}/generate"

        def parse(body: Any) -> Completion:
            if isinstance(body, list) and len(body) == 1:
                body = body[0]  # some versions wrap a single answer in a batch list
            if not isinstance(body, dict):
                raise RetryableAnswer(f"/generate answered {type(body).__name__}, expected an object")
            output_ids = body.get("output_ids")
            if not isinstance(output_ids, list):
                raise RetryableAnswer(
                    f"/generate answer has no list 'output_ids' (got {type(output_ids).__name__}); "
                    f"{_FIX_MALFORMED}"
                )
            meta = body.get("meta_info")
            if not isinstance(meta, dict):
                raise RetryableAnswer(f"/generate answer has no 'meta_info' object; {_FIX_MALFORMED}")
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind == "abort":
                message = reason.get("message") if isinstance(reason, dict) else None
                raise SGLangError(
                    f"{endpoint} aborted the request (finish_reason {reason!r}, message: {message!r}); "
                    "the sample would be silently shortened, so it is rejected; check the server log "
                    "(out of memory, request too long for the served context?)"
                )
            if kind not in ("stop", "length"):
                raise RetryableAnswer(f"/generate answer has unexpected finish_reason {reason!r}")
            ids = self.whole_completion(endpoint, output_ids, reason, max_new_tokens, stop_token_ids,
                                        vocab_size, _FIX_MALFORMED)
            from .served_speed import server_timing

            return Completion(output_ids=ids, finish_reason=kind, meta_info=meta,
                              server_timing=server_timing(body, "sglang"))

        return self._request("POST", "/generate", parse, payload=payload, cancel=cancel)


def served_model_mismatch(model_info: dict[str, Any], target: str) -> str | None:
    """A warning when the SGLang server's model does not look like ``target``, else None."""
    return _mismatch(model_info, target, SGLangClient.name, SGLangClient.url_option)
