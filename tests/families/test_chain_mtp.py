"""The target's own MTP head as a chain drafter: extracted from a tiny Qwen3.5 checkpoint that carries ``mtp.*``
weights (which transformers drops on load), cached beside the layers a block drafter reads, and replayed
cycle for cycle as an independent loop over transformers' ``Qwen3_5DecoderLayer`` wired as vLLM wires it
(``chain_reference.mtp_generate``) runs it, at K = 1, 3 and 5, under both tail conventions, with a stop token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

MAX_NEW = 30
LAYERS = [1, 3]  # a block drafter's layer and the last one (the MTP's: the target's final-normed state)


def train_mtp(drafter, cache, epochs: int = 6, lr: float = 1e-2):
    """Teacher-forced first-step training (row t predicts the token at t + 2), through the replay's own context
    pass: enough for partial acceptance."""
    from dflash_cb.core.drafters.chain import ChainRunner

    head = cache.load_head()
    runner = ChainRunner(drafter, drafter.spec)
    col = cache.manifest.layer_ids.index(drafter.spec.target_layer_ids[0])
    h = cache.manifest.hidden_size
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr)
    data = [cache.load(e.id) for e in cache.samples]
    for _ in range(epochs):
        for s in data:
            ids = s.input_ids.long()
            r = ids.numel() - 2
            feats = s.hidden[:, col * h:(col + 1) * h].float()
            nxt = torch.nn.functional.embedding(ids[1:r + 1], head.embed_tokens)
            ctx = runner.context(iter([(feats, nxt)]), [r])
            loss = torch.nn.functional.cross_entropy(ctx.head_in @ head.lm_head.T, ids[2:r + 2])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from chain_reference import chain_cache
    from safetensors.torch import load_file, save_file
    from tiny_target import save_tiny_qwen3_5

    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.drafters.mtp.model import mtp_config_from_target

    root = tmp_path_factory.mktemp("mtp")
    target_dir = save_tiny_qwen3_5(root / "target", seed=3, mtp_num_hidden_layers=1)
    cache, stop = chain_cache(root, target_dir, LAYERS, MAX_NEW)
    torch.manual_seed(0)
    cfg = mtp_config_from_target(json.loads((target_dir / "config.json").read_text()), 5)
    drafter = train_mtp(drafter_from_config(cfg), cache)
    # The trained head goes into the target's checkpoint under mtp.*, as the released Qwen3.5 / 3.6 ship it.
    shard = target_dir / "model.safetensors"
    state = load_file(str(shard))
    save_file({**state, **{k: v.detach().clone() for k, v in drafter.state_dict().items()}}, str(shard),
              metadata={"format": "pt"})
    return dict(root=root, target_dir=target_dir, cache=cache, drafter=drafter, stop=stop)


def test_the_mtp_head_is_extracted_from_the_target_checkpoint(world, tmp_path: Path) -> None:
    """``--mtp-from`` writes the mtp.* weights as a drafter folder that loads wherever a drafter loads; a target
    without them is refused naming why."""
    from dflash_cb.core.checkpoints.load import CheckpointError, extract_from_target, load_drafter
    from dflash_cb.integrations.cli.extract import main

    assert main(["--mtp-from", str(world["target_dir"]), "--out", str(tmp_path / "mtp"),
                 "--speculative-tokens", "3"]) == 0
    back = load_drafter(tmp_path / "mtp")
    ours = world["drafter"]
    assert type(back) is type(ours) and back.spec.block_size == 4 and back.spec.family == "mtp"
    assert back.spec.target_layer_ids == (3,)
    assert back.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in back.state_dict().items())
    from tiny_target import save_tiny_qwen3_5

    bare = save_tiny_qwen3_5(tmp_path / "bare", seed=1, mtp_num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"no safetensors file holds mtp\.\* weights"):
        extract_from_target(bare, tmp_path / "none")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("tail", ["served", "reference"])
def test_the_replay_equals_a_vllm_wired_mtp_loop(world, tail: str) -> None:
    """Cycle for cycle at K = 1, 3 and 5 (blocks of 2, 4, 6), against transformers' own decoder layer in a
    per-cycle loop; some cycles accept drafts and some do not; samples end at the stop token or at
    max_new_tokens; tau > 1.5."""
    from chain_reference import ReferenceMtp, mtp_generate
    from transformers import Qwen3_5ForConditionalGeneration

    from dflash_cb.core.replay.engine import evaluate

    cache = world["cache"]
    target = Qwen3_5ForConditionalGeneration.from_pretrained(world["target_dir"], dtype=torch.float32).eval()
    ref = ReferenceMtp(target.config.text_config, world["drafter"].state_dict()).eval()
    stops = cache.manifest.stop_token_ids
    for k in (1, 3, 5):
        want = {e.id: mtp_generate(ref, target, cache.load(e.id).input_ids[: e.prompt_len].tolist(), MAX_NEW, stops,
                                   k, tail) for e in cache.samples}
        rep = evaluate(cache, world["drafter"], block_size=k + 1, tail_blocks=tail, budgets=())
        assert {s.id: s.acceptance_lengths for s in rep.samples} == want, k
        cycles = [n for v in want.values() for n in v]
        assert any(n > 1 for n in cycles) and any(n == 1 for n in cycles)
        if k == 3:
            assert rep.summary["tau"] > 1.5
    ends = [cache.load(e.id).input_ids[-1].item() == world["stop"] for e in cache.samples]
    assert any(ends) and not all(ends)


def test_a_chain_refuses_a_ddtree(world) -> None:
    from dflash_cb.common.errors import DFlashCBError
    from dflash_cb.core.replay.engine import evaluate

    with pytest.raises(DFlashCBError, match="MTP drafter drafts each depth from its parent token"):
        evaluate(world["cache"], world["drafter"], budgets=(4,))
