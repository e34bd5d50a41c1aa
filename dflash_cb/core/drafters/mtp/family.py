"""The target's own MTP head (Qwen3.5 / Qwen3.6): a chain drafter read from the target's ``mtp.*`` weights."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from ..chain import ChainFamily
from ..spec import config_value
from .model import ARCHITECTURE


class MtpFamily(ChainFamily):
    name = "mtp"
    label = "MTP"
    architecture = ARCHITECTURE

    def module_class(self) -> type[nn.Module]:
        from .model import MtpDrafter

        return MtpDrafter

    target_prefix = "mtp."
    # vLLM's method "mtp"; SGLang serves Qwen3.5's head as NEXTN, which it runs (and may report) as EAGLE.
    served_methods = ("MTP", "NEXTN", "EAGLE")

    def target_layers(self, config: Any) -> list[int]:
        """The head reads the target's last layer (the hidden state before the final norm), as the server feeds
        it; a config naming another layer would score a drafter no server runs."""
        ids = super().target_layers(config)
        n = config_value(config, "num_target_layers")
        if n is not None and ids != [int(n) - 1]:
            raise ValueError(f"target_layer_ids is {ids}: an MTP head reads the target's last layer, [{int(n) - 1}] "
                             f"of {int(n)}; write the folder again with tools/extract_drafter.py --from-target TARGET")
        return ids

    def tiny_config(self, target_config: dict[str, Any], layer_ids: Sequence[int],
                    speculative_tokens: int) -> dict[str, Any]:
        """One Qwen3.5 MTP layer over a tiny target that ships none (a stand-in for Qwen3.6's own head, as
        ``benchmarks/which_to_serve.py`` trains), reading the target's last layer."""
        return self.config_from_target({**target_config, "mtp_num_hidden_layers": 1, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, speculative_tokens)

    def config_from_target(self, target_config: dict[str, Any], speculative_tokens: int) -> dict[str, Any]:
        from .model import mtp_config_from_target

        return mtp_config_from_target(target_config, speculative_tokens)

    def own_key(self, keys: Iterable[str]) -> str | None:
        return next((k for k in keys if k.startswith("mtp.")), None)


FAMILY = MtpFamily()
