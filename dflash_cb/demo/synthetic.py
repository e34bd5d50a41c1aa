"""A tiny synthetic language and a tiny Qwen3 target that writes it (the CPU demo's target).

The language has three pattern families, one per prompt category, each with a deterministic
continuation that still depends on the prompt, so a trained target has non-trivial greedy
completions and a DFlash drafter has something real to learn:

- ``count``: an arithmetic progression of numbers ``a, a+d, a+2d, ...`` that stops (EOS) before
  it would pass the largest number. Prompt: the family marker and the first three terms.
- ``repeat``: a motif of 2-5 distinct letters followed by ``|``, written five times, then EOS.
  Prompt: the marker and the first copy (copying needs an induction head in the target).
- ``pairs``: letter/number pairs ``L_i N_j, L_{i+1} N_{j+d}, ...`` (numbers wrap around) until the
  last letter, then EOS. Prompt: the marker and the first two pairs.

Everything is seeded: the same seed gives the same data, the same weights and the same prompts.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..common.fileio import atomic_write_text, naming_failures

# -- vocabulary -----------------------------------------------------------------------------
PAD, BOS, EOS, MASK, SEP = 0, 1, 2, 3, 4
MARKERS = {"count": 5, "repeat": 6, "pairs": 7}
FAMILIES = tuple(MARKERS)
NUM0, NUM_COUNT = 8, 32  # number tokens n0..n31 are ids 8..39
LET0, LET_COUNT = 40, 24  # letter tokens A..X are ids 40..63
VOCAB_SIZE = 64
MASK_TOKEN_ID = MASK  # never appears in the data: the drafter's mask token, like Qwen3.6's 248070
SEQ_LEN = 40  # longest sentence of the language: 35 tokens (count with a=0, d=1)
REPEATS = 5


def num(v: int) -> int:
    return NUM0 + v


def let(i: int) -> int:
    return LET0 + i


def token_str(t: int) -> str:
    """A readable name for one token (``n7``, ``C``, ``|``, ``<eos>`` ...)."""
    t = int(t)
    if NUM0 <= t < NUM0 + NUM_COUNT:
        return f"n{t - NUM0}"
    if LET0 <= t < LET0 + LET_COUNT:
        return chr(ord("A") + t - LET0)
    names = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", MASK: "<mask>", SEP: "|"}
    names.update({v: f"<{k}>" for k, v in MARKERS.items()})
    return names.get(t, f"<{t}>")


def decode(ids: Sequence[int]) -> str:
    return " ".join(token_str(t) for t in ids)


# -- the language ---------------------------------------------------------------------------
def sample_sequence(family: str, rng: random.Random) -> tuple[list[int], int]:
    """One sentence of ``family``: (tokens from BOS to EOS, prompt length)."""
    if family == "count":
        d = rng.randint(1, 3)
        a = rng.randint(0, NUM_COUNT - 1 - 8 * d)  # at least 9 terms, so 6+ tokens to complete
        terms = list(range(a, NUM_COUNT, d))
        body = [num(v) for v in terms]
        prompt_len = 2 + 3
    elif family == "repeat":
        k = rng.randint(2, 5)
        motif = [let(i) for i in rng.sample(range(LET_COUNT), k)]
        body = (motif + [SEP]) * REPEATS
        prompt_len = 2 + k + 1
    elif family == "pairs":
        i0 = rng.randint(LET_COUNT - 18, LET_COUNT - 10)  # 10 to 18 pairs
        j0, d = rng.randint(0, NUM_COUNT - 1), rng.randint(1, 4)
        body = []
        for n, i in enumerate(range(i0, LET_COUNT)):
            body += [let(i), num((j0 + n * d) % NUM_COUNT)]
        prompt_len = 2 + 4
    else:
        raise ValueError(f"unknown family {family!r}; families: {FAMILIES}")
    return [BOS, MARKERS[family], *body, EOS], prompt_len


def training_batch(rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], labels [B, T] with -100 on padding), families mixed evenly; T = longest in batch."""
    seqs = [sample_sequence(FAMILIES[b % len(FAMILIES)], rng)[0] for b in range(batch_size)]
    t = max(len(s) for s in seqs)
    ids = torch.full((batch_size, t), PAD, dtype=torch.long)
    labels = torch.full((batch_size, t), -100, dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(seq)
        labels[b, : len(seq)] = torch.tensor(seq)
    return ids, labels


def make_prompts(n_per_family: int, seed: int, prefix: str = "",
                 exclude: Sequence[Sequence[int]] = ()) -> list[dict[str, Any]]:
    """Prompt records (``id``, ``category``, ``input_ids``), families interleaved, no duplicates.

    Prompts in ``exclude`` are skipped (held-out sets). A family with fewer distinct prompts than
    ``n_per_family`` (``count`` has 48) contributes all it has.
    """
    rng = random.Random(f"prompts-{seed}-{prefix}")
    seen: set[tuple[int, ...]] = {tuple(int(t) for t in p) for p in exclude}
    out: list[dict[str, Any]] = []
    counters = dict.fromkeys(FAMILIES, 0)
    misses = dict.fromkeys(FAMILIES, 0)
    active = list(FAMILIES)
    while active:
        for fam in list(active):
            seq, plen = sample_sequence(fam, rng)
            key = tuple(seq[:plen])
            if key in seen:
                misses[fam] += 1
                if misses[fam] > 2000:  # the family is exhausted
                    active.remove(fam)
                continue
            seen.add(key)
            out.append({"id": f"{prefix}{fam}-{counters[fam]:03d}", "category": fam, "input_ids": list(key)})
            counters[fam] += 1
            if counters[fam] >= n_per_family:
                active.remove(fam)
    return out


def write_prompts_jsonl(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


def expected_completion(prompt: Sequence[int]) -> list[int]:
    """The language's own continuation of a prompt made by ``make_prompts`` (up to and including EOS)."""
    fam = {v: k for k, v in MARKERS.items()}[int(prompt[1])]
    body = [int(t) for t in prompt[2:]]
    if fam == "count":
        a, d = body[0] - NUM0, body[1] - body[0]
        full = [num(v) for v in range(a, NUM_COUNT, d)]
    elif fam == "repeat":
        full = body * REPEATS
    else:
        i0, j0, d = body[0] - LET0, body[1] - NUM0, (body[3] - body[1]) % NUM_COUNT
        full = []
        for n, i in enumerate(range(i0, LET_COUNT)):
            full += [let(i), num((j0 + n * d) % NUM_COUNT)]
    return full[len(body):] + [EOS]


# -- the tiny target ------------------------------------------------------------------------
@dataclass
class TargetSpec:
    """Size and training schedule of the tiny target (defaults: about 20-40 s on 2 CPU cores)."""

    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 192
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50


def target_config(spec: TargetSpec) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        rope_theta=10000.0,
    )


@dataclass
class TargetReport:
    path: Path
    train_seconds: float
    final_loss: float
    steps: int
    exact_match: dict[str, float]  # per family: fraction of fresh prompts completed exactly as the language says


def train_tiny_target(out: str | os.PathLike, seed: int = 0, spec: TargetSpec | None = None,
                      log: Callable[[str], None] | None = print) -> TargetReport:
    """Train a tiny ``Qwen3ForCausalLM`` on the synthetic language and ``save_pretrained`` it to ``out``."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    spec = spec or TargetSpec()
    torch.manual_seed(seed)
    rng = random.Random(f"target-data-{seed}")
    model = Qwen3ForCausalLM(target_config(spec)).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 5%
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = time.perf_counter()
    loss_val = float("nan")
    ema = None
    for step in range(spec.steps):
        ids, labels = training_batch(rng, spec.batch_size)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_val = loss.item()
        ema = loss_val if ema is None else 0.95 * ema + 0.05 * loss_val
        if log and (step + 1) % max(1, spec.steps // 5) == 0:
            log(f"  target step {step + 1:4d}/{spec.steps}  loss {ema:.3f}  ({time.perf_counter() - start:.0f}s)")
    seconds = time.perf_counter() - start
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                               do_sample=False)
    out = Path(out)
    with naming_failures(out):  # transformers' write errors name no file
        model.save_pretrained(out)
    atomic_write_text(out / "synthetic_language.json", json.dumps(
        {"vocab_size": VOCAB_SIZE, "families": list(FAMILIES), "mask_token_id": MASK_TOKEN_ID,
         "seed": seed, "train_steps": spec.steps, "final_loss": loss_val,
         "tokens": {str(t): token_str(t) for t in range(VOCAB_SIZE)}}, indent=1) + "\n")
    held_out = make_prompts(8, seed, prefix="check-")
    done = greedy_completions(model, [r["input_ids"] for r in held_out], max_new_tokens=SEQ_LEN)
    exact: dict[str, list[bool]] = {f: [] for f in FAMILIES}
    for r, c in zip(held_out, done, strict=True):
        exact[r["category"]].append(c == expected_completion(r["input_ids"]))
    return TargetReport(out, seconds, loss_val, spec.steps, {f: sum(v) / len(v) for f, v in exact.items()})


@torch.no_grad()
def greedy_completions(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding, stopping at EOS (which is kept); for checks, not for the cache."""
    outs = []
    for p in prompts:
        ids = torch.tensor([list(p)])
        completion: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            completion.append(nxt)
            if nxt == EOS or ids.shape[1] + 1 >= SEQ_LEN:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        outs.append(completion)
    return outs
