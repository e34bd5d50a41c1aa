"""The callback under DDP, FSDP (1) and FSDP2 with two real CPU processes (gloo).

The test launches this file as a script in two processes (RANK/WORLD_SIZE set, so Lightning sees
externally launched ranks) that train the tiny drafter with each strategy in turn. Rank zero writes
the callback's logged metrics and the full drafter weights at every evaluated step. The test then
scores those weights in this single process with ``evaluate()`` (the same profile: light periodic
evaluations, a full one at the last step): the numbers logged by the distributed run must be
identical (every metric but wall time).

Claims checked: each rank scores its share, counts are summed before any ratio (so the logged
numbers equal a single-process evaluation exactly); under FSDP with sharded parameters every
rank takes part in gathering them and the evaluation still sees the whole drafter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from processes import run_ranks

STRATEGIES = ("ddp", "fsdp", "fsdp2")
BUDGETS = [4, 8]
EVERY = 2
MAX_STEPS = 4


# -- worker side -----------------------------------------------------------------------------------

def _worker(cache: str, cfg_path: str, out: str, strategies: list[str]) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from dflash_cb import DFlashEvalCallback
    from dflash_cb.cache import integrity
    from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule
    from dflash_cb.integrations.evaluator.distributed import full_parameters, sharding_kind

    cfg = json.loads(Path(cfg_path).read_text())
    hashed: list[str] = []  # the files sha256 reads in this process, per fit
    real_sha = integrity.sha256_file
    integrity.sha256_file = lambda p, *a, **k: hashed.append(Path(p).name) or real_sha(p, *a, **k)

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning refuses FSDP without CUDA; torch's FSDP runs on CPU with device_id=cpu."""

        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            if not any(isinstance(m, FSDP) for m in model.modules()):
                model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
            return super()._setup_model(model)

        def _determine_device_ids(self):
            return None

        def barrier(self, name=None):
            torch.distributed.barrier()

    class FSDP2Module(DFlashDrafterModule):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            fully_shard(self, mesh=self.device_mesh["data_parallel"])
            register_fsdp_forward_method(self, "training_step")  # training_step, not forward, runs the drafter

    class SaveFullWeights(Callback):
        """At every evaluated step: the whole drafter (gathered on every rank), saved by rank zero."""

        def __init__(self, folder: Path, kinds: list):
            self.folder, self.kinds = folder, kinds

        def _save(self, trainer, pl_module):
            step = trainer.global_step
            self.kinds.append(sharding_kind(trainer))
            with full_parameters(trainer):
                # FSDP2's state_dict hooks hand out DTensors even while unsharded: make them whole.
                state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().cpu()
                         for k, v in pl_module.drafter.state_dict().items()}
            if trainer.global_rank == 0:
                torch.save(state, self.folder / f"drafter_step{step}.pt")

        def on_train_start(self, trainer, pl_module):
            self._save(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step % EVERY == 0:
                self._save(trainer, pl_module)

    import time

    t0 = time.perf_counter()
    for name in strategies:
        folder = Path(out) / name
        folder.mkdir(parents=True, exist_ok=True)
        seed_everything(0, verbose=False)
        if name == "ddp":
            strategy, module_cls = DDPStrategy(process_group_backend="gloo"), DFlashDrafterModule
        elif name == "fsdp":
            strategy, module_cls = CPUFSDPStrategy(process_group_backend="gloo"), DFlashDrafterModule
        else:
            strategy, module_cls = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), FSDP2Module
        module = module_cls(cfg, cache, lr=1e-2, anchors_per_sample=8)
        if name == STRATEGIES[0]:
            # The training module reads (and hashes) the head itself on every rank: count the callback's alone.
            integrity.VERIFIED.clear()
            hashed.clear()
        cb = DFlashEvalCallback(states=cache, every_n_train_steps=EVERY, ddtree_budgets=BUDGETS)
        kinds: list = []
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=MAX_STEPS, logger=False,
                          callbacks=[cb, SaveFullWeights(folder, kinds)], enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=True)
        trainer.fit(module, CachedStatesDataModule(cache, batch_size=2))
        print(f"{name}: fit done at {time.perf_counter() - t0:.1f} s", flush=True)
        (folder / f"hashed_rank{trainer.global_rank}.json").write_text(json.dumps(hashed))
        hashed.clear()
        if trainer.global_rank == 0:
            (folder / "logged.json").write_text(json.dumps({
                "history": cb.history, "sharding": kinds[-1],
                "samples": {s.id: s.acceptance_lengths for s in cb.evaluator.last.samples},
            }))


# -- test side ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def distributed_run(tiny_cache, tiny_drafter_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    cfg = out / "drafter.json"
    cfg.write_text(json.dumps(tiny_drafter_config))
    run_ranks(__file__, [str(tiny_cache), str(cfg), str(out), ",".join(STRATEGIES)], out)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_distributed_logged_metrics_equal_single_process(distributed_run, strategy, tiny_cache, tiny_drafter_config):
    import torch

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.figures.derived import live_metrics
    from dflash_cb.core.figures.metrics import EVAL_OVERHEAD, EVAL_TIME, PREDICTED_SECONDS
    from dflash_cb.core.replay import evaluate

    logged = json.loads((distributed_run / strategy / "logged.json").read_text())
    assert logged["sharding"] == {"ddp": None, "fsdp": "fsdp1", "fsdp2": "fsdp2"}[strategy]
    steps = [h["step"] for h in logged["history"]]
    assert steps == list(range(0, MAX_STEPS + 1, EVERY))
    cache = StateCache(tiny_cache)
    for h in logged["history"]:
        drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
        drafter.load_state_dict(torch.load(distributed_run / strategy / f"drafter_step{h['step']}.pt"))
        # Every evaluation's main keys: the light profile (stride = block size, the largest budget); the last
        # step's is full and adds stride 1 and every budget under full/.
        categories = sorted({s.category for s in cache.samples})
        full = h["step"] == MAX_STEPS
        profiles = [("", BUDGETS[-1:], drafter.block_size)] + ([("full/", BUDGETS, 1)] if full else [])
        for prefix, budgets, stride in profiles:
            report = evaluate(cache, drafter.eval(), budgets=budgets, anchor_stride=stride)
            # Counts-based metrics, plus what rank zero derives from the gathered per-sample lengths
            # (intervals, position/cycle taus): all identical to a single process.
            expected = {**report.summary, **live_metrics(report.samples, budgets, categories, anchor_stride=stride)}
            assert any(k.endswith("_ci_low") for k in expected) and "position/0_8/tau" in expected
            assert h[prefix + "samples"] == len(cache) == expected["samples"]
            mine = {k[len(prefix):]: v for k, v in h.items() if k.startswith(prefix) and (prefix or "/" not in k
                                                                                          or not k.startswith("full/"))}
            for k, v in expected.items():
                if full and not prefix and k in ("anchors_drafted", "anchors_needed"):
                    continue  # the cost of the pass that ran: the full one
                if k == "anchors_drafted" and not prefix:
                    continue  # how the light pass drafted: every anchor at once where that is cheaper
                got = mine[k]
                assert got == v or (got != got and v != v), (strategy, h["step"], prefix, k, got, v)  # NaN == NaN
            assert set(mine) - set(expected) - {PREDICTED_SECONDS} == {"step", EVAL_TIME, EVAL_OVERHEAD} - (
                {"step"} if prefix else set())
    assert logged["samples"] == {s.id: s.acceptance_lengths for s in report.samples}


@pytest.mark.e2e
def test_distributed_runs_agree_with_each_other_at_fit_start(distributed_run):
    """Same seed, same initial weights: the step-0 numbers of DDP, FSDP and FSDP2 are identical."""
    firsts = []
    for s in STRATEGIES:
        h = json.loads((distributed_run / s / "logged.json").read_text())["history"][0]
        firsts.append({k: v for k, v in h.items() if k not in ("eval_time_s", "eval_overhead")})
    assert json.dumps(firsts[0], sort_keys=True) == json.dumps(firsts[1], sort_keys=True) == json.dumps(
        firsts[2], sort_keys=True)


@pytest.mark.e2e
def test_each_rank_hashes_only_its_share_and_the_head_once(distributed_run, tiny_cache):
    """In the first fit (DDP) rank r hashes the shards of the samples it scores
    (``ids[r::2]``) and only rank zero the head; the later fits in the same processes (FSDP, FSDP2:
    new callbacks, new StateCaches) hash nothing."""
    from dflash_cb.cache.states import StateCache

    cache = StateCache(tiny_cache)
    ids = [s.id for s in cache.samples]
    got = {s: [json.loads((distributed_run / s / f"hashed_rank{r}.json").read_text()) for r in range(2)]
           for s in STRATEGIES}
    head = cache.manifest.target_head["file"]
    assert sorted(got["ddp"][0]) == sorted([*cache.shards_of(ids[0::2]), head])
    assert sorted(got["ddp"][1]) == sorted(cache.shards_of(ids[1::2]))
    assert not set(got["ddp"][0]) & set(got["ddp"][1]) - {head}
    assert got["fsdp"] == got["fsdp2"] == [[], []]


if __name__ == "__main__":
    from dflash_cb.integrations.evaluator.distributed import end_process_group

    _worker(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(","))
    end_process_group()  # Lightning leaves its process group up: every rank done before either tears it down
