"""Tiny, real Hugging Face target checkpoints for tests (shared helpers; other test files import this).

Each builder makes a randomly initialised model with a fixed seed, saves it with
``save_pretrained`` into ``folder`` and returns the folder. The models are small enough
to load, generate and prefill in milliseconds on CPU, but they exercise the real
classes: Qwen3 (dense) and Qwen3.5 (vision-language wrapper, hybrid linear attention).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY_VOCAB = 128
TINY_HIDDEN = 32
TINY_LAYERS = 4


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def save_tiny_qwen3(folder: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """A tiny ``Qwen3ForCausalLM`` (vocab 128, hidden 32, 4 layers, float32) saved to ``folder``."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(**overrides)).to(torch.float32).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def qwen3_5_config(**text_overrides):
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        # Like Qwen3.6: three Gated DeltaNet layers, then one full-attention layer.
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        eos_token_id=2,
    )
    text.update(text_overrides)
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=TINY_HIDDEN,
        patch_size=4,
        num_position_embeddings=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return Qwen3_5Config(text_config=text, vision_config=vision)


def save_tiny_qwen3_5(folder: str | os.PathLike, seed: int = 0, **text_overrides) -> Path:
    """A tiny ``Qwen3_5ForConditionalGeneration`` saved WITH its vision tower (keys ``model.visual.*``)."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(qwen3_5_config(**text_overrides)).to(torch.float32).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def weight_files(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def delete_tensor(folder: str | os.PathLike, key_substring: str) -> str:
    """Rewrite the checkpoint without the first tensor whose name contains ``key_substring``; return its name."""
    for path in weight_files(folder):
        tensors = load_file(str(path))
        victim = next((k for k in sorted(tensors) if key_substring in k), None)
        if victim is None:
            continue
        del tensors[victim]
        save_file(tensors, str(path), metadata={"format": "pt"})
        index = Path(folder) / "model.safetensors.index.json"
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"].pop(victim, None)
            index.write_text(json.dumps(data))
        return victim
    raise KeyError(f"no tensor matching {key_substring!r} in {folder}")


def write_prompts(path: str | os.PathLike, prompts: list[list[int]], categories: list[str] | None = None,
                  prefix: str = "p") -> Path:
    """Write an ``input_ids`` prompt JSONL (no tokenizer needed) and return its path."""
    path = Path(path)
    lines = []
    for i, ids in enumerate(prompts):
        rec = {"id": f"{prefix}{i:03d}", "input_ids": list(ids)}
        if categories:
            rec["category"] = categories[i % len(categories)]
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def random_prompts(n: int, length: int | tuple[int, int], seed: int = 0, vocab: int = TINY_VOCAB,
                   low: int = 3) -> list[list[int]]:
    """``n`` random token-id prompts (ids >= ``low`` so they avoid pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if isinstance(length, tuple):
            t = int(torch.randint(length[0], length[1] + 1, (1,), generator=g))
        else:
            t = length
        out.append(torch.randint(low, vocab, (t,), generator=g).tolist())
    return out


TINY_WORDS = [
    "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "user", "assistant", "system",
    "hello", "world", "what", "is", "2", "+", "?", "you", "are", "helpful",
]  # fmt: skip

# Qwen-style: thinking on by default; enable_thinking=False pre-fills an empty think block.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant "
    "{% if enable_thinking is defined and not enable_thinking %}<think> </think> {% endif %}{% endif %}"
)


def tiny_tokenizer():
    """A whitespace word-level tokenizer over ``TINY_WORDS`` (ids < 18) with a Qwen-like chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    hf.chat_template = TINY_CHAT_TEMPLATE
    return hf


def save_tiny_tokenizer(folder: str | os.PathLike) -> Path:
    """``tiny_tokenizer()`` saved into ``folder``."""
    folder = Path(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def train_briefly(drafter, cache, epochs: int = 6, lr: float = 3e-3, seed: int = 0, loss=None):
    """A few epochs of DFlash training on ``cache``: partial acceptance, the regime where exactness
    checks (rounds, accepted lengths) carry information. ``loss(drafter, head, sample, anchors, valid_len)``
    replaces the DFlash loss (``selector_loss``). Returns the drafter in eval mode."""
    from dflash_cb.core.drafters.training import dflash_loss, sample_anchors

    head = cache.load_head()
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    data = list(zip(cache.samples, cache.load_many([e.id for e in cache.samples]), strict=True))  # read once
    for _ in range(epochs):
        for e, s in data:
            anchors = sample_anchors(e.prompt_len, e.valid_len, 16, g)
            if anchors.numel() == 0:
                continue
            if loss is None:
                value, _ = dflash_loss(drafter, head, s.hidden, s.input_ids, anchors, e.valid_len)
            else:
                value = loss(drafter, head, s, anchors, e.valid_len)
            opt.zero_grad()
            value.backward()
            opt.step()
    return drafter.eval()


def selector_loss(drafter, head, sample, anchors, valid_len):
    """A DFlash 2 drafter's loss for ``train_briefly``: the package's (``training.dflash_loss``, which adds the
    selector's cross-entropy over its candidates for a DFlash 2 drafter), uniform over depths."""
    from dflash_cb.core.drafters.training import dflash_loss

    return dflash_loss(drafter, head, sample.hidden, sample.input_ids.long(), anchors, valid_len)[0]


TINY_LAYER_IDS = [0, 2]
TINY_MASK = 127  # prompts use ids < 120, so the mask token never appears in them


def build_tiny_cache(root: Path, n_prompts: int = 6, max_new_tokens: int = 24, prompt_seed: int = 1) -> Path:
    """Tiny target + prompts + cache under ``root``; returns the cache folder."""
    from dflash_cb.cache.precompute import PrecomputeArgs, run_precompute

    target = save_tiny_qwen3(root / "target", seed=0)
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(n_prompts, (5, 10), seed=prompt_seed, vocab=120),
                            categories=["code", "chat"])
    out = root / "cache"
    run_precompute(PrecomputeArgs(target=str(target), prompts=str(prompts), out=str(out), layers=TINY_LAYER_IDS,
                                  reference="local", dtype="float32", max_new_tokens=max_new_tokens, progress=False))
    return out


ORACLE_LAYERS = [1, 3]  # the oracle world's drafter layers: outputs of decoder layers 1 and 3 of the 4-layer target
ORACLE_MAX_NEW = 40


def build_oracle_world(root: Path) -> dict:
    """What the exactness tests against a reference generate loop start from (test_oracle, test_dflash2_engine, the
    families' conformance suite): a tiny target (seed 3) and six prompts in three categories, a plain cache of them
    (``--reference local --dtype float32``, layers ``ORACLE_LAYERS``, ``ORACLE_MAX_NEW`` new tokens), and a second
    cache with a stop token that two completions meet a few tokens in (so two samples stop and the others reach
    max_new_tokens, where the tail-block conventions part) and the target's top-8 log-probs stored."""
    from collections import Counter

    from transformers import Qwen3ForCausalLM

    from dflash_cb.cache.precompute import main
    from dflash_cb.cache.states import StateCache

    def precompute(out: Path, *extra: str) -> StateCache:
        assert main(["--target", str(target_dir), "--prompts", str(prompts), "--out", str(out), "--layers",
                     ",".join(map(str, ORACLE_LAYERS)), "--reference", "local", "--dtype", "float32",
                     "--max-new-tokens", str(ORACLE_MAX_NEW), "--no-progress", *extra]) == 0
        return StateCache(out)

    target_dir = save_tiny_qwen3(root / "target", seed=3)
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(6, (4, 12), seed=5, vocab=120),
                            categories=["math", "code", "chat"])
    plain = precompute(root / "plain")
    seen = [set(plain.load(e.id).input_ids[e.prompt_len + 6:].tolist()) for e in plain.samples]
    stop = next(t for t, n in Counter(t for s in seen for t in s).most_common() if n == 2)
    cache = precompute(root / "cache", "--stop-token-ids", str(stop), "--topk-logprobs", "8")
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return dict(target_dir=target_dir, prompts=prompts, plain=plain, stop=stop, cache=cache, target=target)
