"""dflash_cb.cache.target on real tiny checkpoints: config reading, strict loading, layer capture, chunked head."""

from __future__ import annotations

import pytest
import torch
from tiny_target import (
    TINY_HIDDEN,
    TINY_LAYERS,
    TINY_VOCAB,
    delete_tensor,
    save_tiny_qwen3,
    save_tiny_qwen3_5,
)

from dflash_cb.cache.target import (
    TargetError,
    check_layer_ids,
    find_decoder_layers,
    greedy_generate,
    head_stats,
    head_tensors,
    load_target,
    prefill,
    read_target_config,
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


def test_read_config_without_weights(qwen3_dir, qwen3_5_dir, tmp_path):
    c3 = read_target_config(qwen3_dir)
    assert (c3.architecture, c3.num_layers, c3.hidden_size, c3.vocab_size) == (
        "Qwen3ForCausalLM", TINY_LAYERS, TINY_HIDDEN, TINY_VOCAB)
    assert c3.max_position_embeddings == 512 and c3.eos_token_ids == [2]
    # qwen3_5 keeps the text model's sizes under text_config; the vision tower's must not leak in
    c35 = read_target_config(qwen3_5_dir)
    assert c35.architecture == "Qwen3_5ForConditionalGeneration"
    assert (c35.num_layers, c35.hidden_size, c35.vocab_size) == (TINY_LAYERS, TINY_HIDDEN, TINY_VOCAB)
    assert len(c35.config_sha256) == 64 and c35.config_sha256 != c3.config_sha256
    with pytest.raises(TargetError, match="no config.json"):
        read_target_config(tmp_path)


def test_layer_id_checks():
    assert check_layer_ids([3, 0], 4) == [3, 0]
    with pytest.raises(ValueError, match=r"\[4\] are outside \[0, 4\)"):
        check_layer_ids([0, 4], 4)
    with pytest.raises(ValueError, match="duplicate"):
        check_layer_ids([1, 1], 4)


@pytest.mark.parametrize("which", ["qwen3", "qwen3_5"])
def test_hook_capture_equals_hidden_states_i_plus_1(which, qwen3_dir, qwen3_5_dir):
    target = load_target(qwen3_dir if which == "qwen3" else qwen3_5_dir, "float32")
    if which == "qwen3_5":
        # the text model alone, without the vision tower; hybrid linear/full attention layers
        assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
        assert not any("visual" in n for n, _ in target.model.named_parameters())
        assert [type(layer.linear_attn).__name__ for layer in target.layers[:3]] == ["Qwen3_5GatedDeltaNet"] * 3
    assert find_decoder_layers(target.model) is target.layers
    ids = torch.randint(3, TINY_VOCAB, (37,), generator=torch.Generator().manual_seed(1))
    layer_ids = [2, 0, 3]  # out of order, and the last layer (HF's hidden_states[-1] is final-normed)
    res = prefill(target, ids, layer_ids, topk=5)
    with torch.no_grad():
        ref = target.model(ids[None], output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    assert res.hidden.shape == (37, len(layer_ids) * TINY_HIDDEN) and res.hidden.dtype == torch.float32
    torch.testing.assert_close(res.hidden, expected, rtol=0, atol=0)
    # the off-by-one this convention exists for: hidden_states[i] is a different tensor
    assert not torch.allclose(res.hidden[:, :TINY_HIDDEN], ref.hidden_states[2][0])
    assert torch.equal(res.target_argmax, ref.logits[0].argmax(-1))
    logp = torch.log_softmax(ref.logits[0].float(), -1)
    top = logp.topk(5, dim=-1)
    assert torch.equal(res.topk_ids, top.indices)
    torch.testing.assert_close(res.topk_logprobs, top.values, rtol=1e-5, atol=1e-5)


def test_head_stats_chunking_matches_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(23, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    for chunk in (1, 5, 256):
        am, ids, lps = head_stats(hidden, head, topk=3, chunk=chunk)
        full = head(hidden)
        assert torch.equal(am, full.argmax(-1))
        torch.testing.assert_close(lps, torch.log_softmax(full, -1).topk(3).values)
    am, ids, lps = head_stats(hidden, head, topk=0, chunk=4)
    assert ids is None and lps is None


def test_missing_tensor_is_refused(tmp_path):
    folder = save_tiny_qwen3(tmp_path / "broken")
    victim = delete_tensor(folder, "layers.1.mlp.up_proj")
    with pytest.raises(TargetError, match=r"missing from the checkpoint \(model\.safetensors\)") as err:
        load_target(folder, "float32")
    assert "layers.1.mlp.up_proj.weight" in str(err.value) and victim.endswith("up_proj.weight")


def test_missing_tensor_in_vlm_checkpoint_is_refused(tmp_path):
    folder = save_tiny_qwen3_5(tmp_path / "broken35")
    delete_tensor(folder, "language_model.layers.2.linear_attn.A_log")
    with pytest.raises(TargetError, match=r"layers\.2\.linear_attn\.A_log"):
        load_target(folder, "float32")


def test_wrong_shape_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_qwen3(tmp_path / "shape")
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(TINY_HIDDEN, 65)
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(TargetError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        load_target(folder, "float32")


def test_greedy_generate_and_head_export(qwen3_dir, tmp_path):
    target = load_target(qwen3_dir, "float32")
    prompt = [5, 6, 7, 8, 9]
    comp, reason = greedy_generate(target, prompt, 12, [])
    assert len(comp) == 12 and reason == "length"
    stop = comp[4]
    comp2, reason2 = greedy_generate(target, prompt, 12, [stop])
    assert comp2 == comp[: comp.index(stop) + 1] and reason2 == "stop"
    # greedy = the prefill's own argmax along the path
    res = prefill(target, prompt + comp, [0])
    assert res.target_argmax[len(prompt) - 1:-1].tolist() == comp
    tensors, tied = head_tensors(target)
    assert not tied and set(tensors) == {"embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(tensors["lm_head.weight"], target.model.lm_head.weight)

    tied_dir = save_tiny_qwen3(tmp_path / "tied", tie_word_embeddings=True)
    tensors, tied = head_tensors(load_target(tied_dir, "float32"))
    assert tied and set(tensors) == {"embed_tokens.weight"}


def test_bfloat16_load(qwen3_dir):
    target = load_target(qwen3_dir, "bfloat16")
    res = prefill(target, list(range(3, 20)), [1, 2])
    assert res.hidden.dtype == torch.bfloat16 and res.hidden.shape == (17, 2 * TINY_HIDDEN)


def test_head_stats_top_k_argmax_keeps_the_first_maximal_index():
    """One pass over the head: the argmax read off the top-K equals argmax() on ties too."""
    hidden = torch.eye(4)
    head = torch.nn.Linear(4, 6, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0, 1, 0, 1], [2, 0, 0, 1], [2, 0, 1, 1], [1, 0, 1, 1],
                                        [2, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float32))
    full = head(hidden)  # row 0: ties at 2 (ids 1, 2, 4); row 3: six-way tie at 1
    for k in (1, 2, 3, 6):
        am, ids, lps = head_stats(hidden, head, topk=k, chunk=3)
        assert torch.equal(am, full.argmax(-1)), k
        torch.testing.assert_close(lps, torch.log_softmax(full, -1).gather(-1, ids))


def test_head_stats_bfloat16_logprobs_close_to_float32():
    """bfloat16 logits are not copied to float32 for the top-K: the log-probs stay within 0.01 nats."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 300, bias=False).bfloat16()
    for scale in (3, 300):  # logits of a few units, and beyond +-80 (exp would overflow unshifted)
        hidden = (scale * torch.randn(40, 16)).bfloat16()
        am, ids, lps = head_stats(hidden, head, topk=5, chunk=16)
        with torch.no_grad():
            full = head(hidden).float()
        assert torch.equal(am, full.argmax(-1)) and lps.dtype == torch.float32
        assert torch.equal(full.gather(-1, ids), full.topk(5).values)
        ref = torch.log_softmax(full, -1).gather(-1, ids)
        torch.testing.assert_close(lps, ref, rtol=0, atol=0.01 * max(1.0, ref.abs().max().item() / 100))


def test_head_stats_top_k_in_row_slices():
    """A large vocabulary is processed in row slices of ~1 MiB inside each chunk: same results."""
    torch.manual_seed(2)
    hidden = torch.randn(21, 16)
    head = torch.nn.Linear(16, 40_000, bias=False)  # 160 kB per float32 row: 6 rows per slice
    am, ids, lps = head_stats(hidden, head, topk=4, chunk=16)
    with torch.no_grad():
        full = head(hidden)
    assert torch.equal(am, full.argmax(-1)) and torch.equal(ids, full.topk(4).indices)
    torch.testing.assert_close(lps, torch.log_softmax(full, -1).topk(4).values)
