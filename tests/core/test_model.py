"""Our DFlash drafter against the reference ``dflash.model.DFlashDraftModel`` (same weights)."""

from __future__ import annotations

import oracles
import pytest
import torch
from transformers import Qwen3Config

from dflash_cb.core.drafters.dflash.model import DFlashDrafter

dm = oracles.require("dflash.model")


def _config(sliding: bool) -> Qwen3Config:
    d = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512, num_target_layers=4, block_size=4,
             dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 63})
    if sliding:
        # A real window (Qwen3Config drops it unless use_sliding_window), far shorter than the contexts.
        d.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True)
    return Qwen3Config(**d)


@pytest.mark.parametrize("sliding", [False, True])
def test_batched_blocks_equal_reference_forward(sliding: bool) -> None:
    """Many anchors in one pass (packed groups, shorter tail blocks) = one reference call per anchor."""
    torch.manual_seed(0)
    cfg = _config(sliding)
    ref = dm.DFlashDraftModel(cfg).eval()
    ours = DFlashDrafter(cfg).eval()
    ours.load_state_dict(ref.state_dict())
    features = torch.randn(200, 64)
    anchors = torch.sort(torch.randperm(190)[:37] + 5).values  # long contexts: several blocks per group
    lengths = torch.randint(2, 5, (37,))
    emb = torch.randn(37, 4, 32)
    with torch.no_grad():
        fast = ours.forward_blocks(ours.context_kv(features), emb, anchors, lengths)
        for i, p in enumerate(anchors.tolist()):
            n = int(lengths[i])
            pos = torch.arange(p + n)[None]
            want = ref(target_hidden=features[None, :p], noise_embedding=emb[i:i + 1, :n], position_ids=pos)[0]
            got_ref_signature = ours(target_hidden=features[None, :p], noise_embedding=emb[i:i + 1, :n],
                                     position_ids=pos)[0]
            assert torch.allclose(fast[i, :n], want, atol=1e-5), p
            assert torch.allclose(got_ref_signature, want, atol=1e-5), p


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("attn_mem_bytes", [None, 1, 20_000])
def test_deferred_last_layer_rows_equal_reference(sliding: bool, attn_mem_bytes: int | None) -> None:
    """block_rows: the rows asked for, of samples of very different lengths (tail blocks, a window shorter than
    the contexts) sharing attention calls (no limit), one block a call (1 byte) or a few, equal one reference
    call per anchor and the finished pass (forward_samples); the samples' context K/V projected together
    equals each sample's own."""
    torch.manual_seed(1)
    cfg = _config(sliding)
    ref = dm.DFlashDraftModel(cfg).eval()
    ours = DFlashDrafter(cfg).eval()
    ours.load_state_dict(ref.state_dict())
    feats = [torch.randn(t, 64) for t in (3, 120, 40)]
    # Sample 0: one block right after a 2-token prompt; 1: many long-context blocks; 2: a single tail block.
    plan = [[2], [7, 50, 51, 90, 117], [38]]
    anchors = torch.tensor([p for ps in plan for p in ps])
    who = [s for s, ps in enumerate(plan) for _ in ps]
    samples = torch.tensor(who)
    lengths = torch.tensor([min(4, f.shape[0] - p) for f, ps in zip(feats, plan, strict=True) for p in ps])
    emb = torch.randn(len(anchors), 4, 32)
    with torch.no_grad():
        context = ours.context_kv(feats)
        for s, f in enumerate(feats):
            alone = ours.context_kv(f)
            rows = slice(context.starts[s], context.starts[s] + f.shape[0])
            for (k, v), (k1, v1) in zip(context.layers, alone.layers, strict=True):
                assert torch.allclose(k[:, rows], k1, atol=1e-6) and torch.allclose(v[:, rows], v1, atol=1e-6)
        full = ours.forward_samples(context, emb, anchors, samples, lengths, attn_mem_bytes)
        deferred = ours.block_rows(context, emb, anchors, samples, lengths, attn_mem_bytes)
        block = torch.tensor([0, 1, 1, 3, 5, 6])  # some blocks, some positions, in any order
        pos = torch.tensor([1, 3, 0, 2, 1, 1])
        got = deferred.rows(block, pos)
        assert torch.allclose(got, full[block, pos], atol=1e-6)
        every = deferred.rows(torch.arange(len(anchors))[:, None], torch.arange(4)[None, :])
        assert every.shape == full.shape
        for i, p in enumerate(anchors.tolist()):
            n = int(lengths[i])
            want = ref(target_hidden=feats[who[i]][None, :p], noise_embedding=emb[i:i + 1, :n],
                       position_ids=torch.arange(p + n)[None])[0]
            assert torch.allclose(every[i, :n], want, atol=1e-5), (who[i], p)


def test_checkpoint_round_trip_and_strict_loading(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    ours = DFlashDrafter(_config(True))
    ours.save_pretrained(tmp_path / "d")
    back = DFlashDrafter.from_pretrained(tmp_path / "d")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values(), strict=True))
    ref = dm.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32)
    assert torch.equal(ref.fc.weight, ours.fc.weight)
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    del state["layers.1.mlp.down_proj.weight"]
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.down_proj.weight'\]"):
        DFlashDrafter.from_pretrained(tmp_path / "d")


def test_a_load_that_fits_builds_no_other_familys_layout(drafter_dir, tmp_path, monkeypatch) -> None:
    """The other families' layouts (a module each) are built only to name the closest one when the keys differ:
    a checkpoint that fits loads without them, one that does not still names its keys."""
    from safetensors.torch import load_file, save_file

    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter
    from dflash_cb.core.drafters import layouts

    built, real = [], layouts.layouts
    monkeypatch.setattr(layouts, "layouts", lambda config: built.append(1) or real(config))
    load_drafter(drafter_dir)
    assert built == []
    state = load_file(str(drafter_dir / "model.safetensors"))
    dropped = sorted(state)[0]
    del state[dropped]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((drafter_dir / "config.json").read_text())
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"missing \['{dropped}'\]"):
        load_drafter(broken)
    assert built == [1]


def test_forward_compiles_as_one_graph() -> None:
    """The training path has no data-dependent branch: torch.compile(fullgraph=True) traces it whole."""
    torch.manual_seed(0)
    ours = DFlashDrafter(_config(True)).eval()
    assert ours.layers[0].self_attn.reach_back == 5 and ours.layers[1].self_attn.unrestricted
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    features, emb = torch.randn(2, 10, 64), torch.randn(2, 4, 32)
    pos = torch.arange(14)[None].expand(2, 14)
    mask = torch.rand(2, 1, 4, 14) > 0.3
    with torch.no_grad():
        for m in (None, mask):
            want = ours(position_ids=pos, noise_embedding=emb, target_hidden=features, attention_mask=m)
            got = compiled(position_ids=pos, noise_embedding=emb, target_hidden=features, attention_mask=m)
            assert torch.allclose(got, want, atol=1e-5)


def test_specforge_masks_differ_only_for_a_window_shorter_than_the_block_or_is_causal():
    """SpecForge 0.2.0 windows a sliding layer over the context only and ignores is_causal."""
    from transformers import Qwen3Config

    from dflash_cb.core.drafters.dflash.model import specforge_mask_difference

    def config(**kw):
        base = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=7,
                    use_sliding_window=True)
        return Qwen3Config(**{**base, **kw})

    assert specforge_mask_difference(config(), 6) is None  # window 7 >= block 6: same masks
    assert specforge_mask_difference(config(), 7) is None
    assert "layer 0 (sliding_attention, sliding_window 7)" in specforge_mask_difference(config(), 8)
    assert "is_causal True" in specforge_mask_difference(config(is_causal=True), 6)  # the full layer turns causal
    assert "is_causal False" in specforge_mask_difference(config(is_causal=False), 6)  # the window reaches ahead
    assert specforge_mask_difference(config(layer_types=["full_attention"] * 2), 16) is None
