"""The live evaluator outside Lightning: a real ``transformers.Trainer`` run and a plain PyTorch loop
(also under 2-process ``torch.distributed``), on CPU with the tiny drafter and the tiny cache.

Claims checked: at every evaluated step the logged numbers equal ``tools/eval_drafter.py`` on the
weights of that step; the 2-rank plain loop logs what one process logs; a run resumed from a
saved state neither repeats nor skips an evaluation; the documented snippets (docs/training-loops.md) run as shown.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import run_ranks
from torch import nn

from dflash_cb.common.errors import DFlashCBError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # as a rank script too

from tool_runs import BUDGETS, PREFIX, assert_step_equals_tool  # noqa: E402

# -- the plain loop -------------------------------------------------------------------------------

def plain_loop(cache: str, cfg: dict, steps: int, every: int, out: Path | None = None,
               state: dict | None = None, grad_sync: bool = False, **options: Any):
    """A hand-written training loop with the evaluator: 5 added lines, marked ``# eval``.

    ``state``: resume from ``{"step", "drafter", "optimizer", "evaluator"}``. ``out``: the drafter is
    saved there at every evaluated step. ``grad_sync``: average gradients over ``torch.distributed``
    ranks (every rank trains on the same batches, so the weights equal a single process's).
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from dflash_cb import DFlashDrafter, LiveEvaluator
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.training import batch_loss
    from dflash_cb.demo.lightning_module import CachedStatesDataset, collate_samples

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(cfg)
    head = StateCache(cache).load_head(dtype=torch.float32)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    step = 0
    logged: dict[int, dict[str, float]] = {}
    def collect(metrics: dict[str, float], s: int) -> None:  # the evaluations (not the setup line's figures)
        if PREFIX + "tau" in metrics:
            logged[s] = metrics

    sinks = [collect, *([options.pop("log")] if "log" in options else [])]
    evaluator = LiveEvaluator(cache, every_n_train_steps=every, max_steps=steps, ddtree_budgets=BUDGETS,  # eval
                              log=sinks, console=False, **options)
    if state is not None:
        step = state["step"]
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        evaluator.load_state_dict(state["evaluator"])
        torch.manual_seed(step)

    def saved(metrics: dict | None) -> None:
        if metrics is not None and out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            drafter.save_pretrained(out / f"drafter_{step}")

    saved(evaluator.start(step, drafter))  # eval
    data = DataLoader(CachedStatesDataset(cache), batch_size=2, shuffle=True, collate_fn=collate_samples)
    checkpoints = {}
    while step < steps:
        for batch in data:
            loss, _ = batch_loss(drafter, head, batch, anchors_per_sample=8)
            loss.backward()
            if grad_sync and dist.is_initialized():
                for p in drafter.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            saved(evaluator.step(step, drafter))  # eval
            checkpoints[step] = {"step": step, "drafter": {k: v.clone() for k, v in drafter.state_dict().items()},
                                 "optimizer": optimizer.state_dict(), "evaluator": evaluator.state_dict()}  # eval
            if step == steps:
                break
    saved(evaluator.finish(step, drafter))  # eval
    return evaluator, logged, checkpoints


@pytest.mark.e2e
def test_plain_loop_logs_the_tools_tau_at_every_evaluated_step(tmp_path, tiny_cache, tiny_drafter_config):
    evaluator, logged, _ = plain_loop(str(tiny_cache), tiny_drafter_config, steps=4, every=2, out=tmp_path)
    assert sorted(logged) == [0, 2, 4] == [h["step"] for h in evaluator.history]
    assert logged[4][PREFIX + "tau"] != logged[0][PREFIX + "tau"]  # it trained between evaluations
    block = tiny_drafter_config["block_size"]
    for step in (0, 2, 4):
        assert_step_equals_tool(tiny_cache, tmp_path / f"drafter_{step}", tmp_path / f"r{step}.json", logged[step],
                                step == 4, block, step)


@pytest.mark.e2e
def test_plain_loop_resume_neither_repeats_nor_skips(tiny_cache, tiny_drafter_config):
    first, logged, checkpoints = plain_loop(str(tiny_cache), tiny_drafter_config, steps=5, every=2,
                                            eval_on_fit_end=False)
    assert [h["step"] for h in first.history] == [0, 2, 4] and sorted(logged) == [0, 2, 4]
    resumed, logged, _ = plain_loop(str(tiny_cache), tiny_drafter_config, steps=8, every=2, state=checkpoints[4])
    # Restored history [0, 2, 4]; the resumed run evaluates 6 and 8 only (no start evaluation, no second 4).
    assert [h["step"] for h in resumed.history] == [0, 2, 4, 6, 8] and sorted(logged) == [6, 8]
    assert resumed.state.num_evals == 5


@pytest.mark.e2e
def test_plain_loop_into_a_wandb_run_logs_todays_keys_table_and_chart(tmp_path, tiny_cache, tiny_drafter_config):
    """``log=wandb.init(...)``: the scalars against trainer/global_step, the samples table, the histogram and
    the per-depth chart, the best tau in the summary: what the Lightning callback's WandbLogger run holds."""
    import wandb
    from wandb_runs import history_and_summary

    run = wandb.init(project="dflash-cb-test", name="plain", dir=str(tmp_path), mode="offline", reinit="create_new")
    evaluator, _, _ = plain_loop(str(tiny_cache), tiny_drafter_config, steps=2, every=1, log=run, table_samples=2)
    run_dir = Path(run.dir).parent
    run.finish()
    history, summary, defined = history_and_summary(run_dir)
    assert ("dflash_eval/*", "trainer/global_step") in defined
    evals = [h for h in history if PREFIX + "tau" in h]
    assert [h["trainer/global_step"] for h in evals] == [0, 1, 2] == [h["step"] for h in evaluator.history]
    assert [h[PREFIX + "tau"] for h in evals] == [h["tau"] for h in evaluator.history]
    objects = [h for h in history if PREFIX + "sample_table/path" in h]
    assert [h["trainer/global_step"] for h in objects] == [0, 1, 2]
    assert all(h[PREFIX + "produced_hist/_type"] == "histogram" for h in objects)
    assert all(PREFIX + "charts/acceptance_per_depth_table/path" in h for h in objects)
    assert summary[PREFIX + "best/tau"] == max(h["tau"] for h in evaluator.history)


# -- the plain loop under torch.distributed (2 gloo processes) -------------------------------------

def _worker(cache: str, cfg_path: str, out: str) -> None:
    import torch.distributed as dist

    from dflash_cb.integrations.evaluator.distributed import end_process_group

    dist.init_process_group("gloo")
    cfg = json.loads(Path(cfg_path).read_text())
    evaluator, logged, _ = plain_loop(cache, cfg, steps=4, every=2, grad_sync=True)
    rank = dist.get_rank()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "logged": logged, "history": evaluator.history,
        "samples": {s.id: s.acceptance_lengths for s in evaluator.last.samples}}))
    end_process_group()


@pytest.mark.e2e
def test_plain_loop_on_two_ranks_equals_one_process(tmp_path, tiny_cache, tiny_drafter_config):
    cfg = tmp_path / "drafter.json"
    cfg.write_text(json.dumps(tiny_drafter_config))
    run_ranks(__file__, [str(tiny_cache), str(cfg), str(tmp_path)], tmp_path, env={"PYTHONPATH": str(ROOT)})

    single, logged, _ = plain_loop(str(tiny_cache), tiny_drafter_config, steps=4, every=2)
    two = json.loads((tmp_path / "rank0.json").read_text())
    assert sorted(int(s) for s in two["logged"]) == [0, 2, 4] == sorted(logged)
    for step, metrics in logged.items():
        theirs = two["logged"][str(step)]
        assert set(theirs) == set(metrics)
        for k, v in metrics.items():
            if not k.endswith(("eval_time_s", "eval_overhead", "predicted/seconds")):  # wall time (also under full/)
                assert theirs[k] == v, (step, k, theirs[k], v)
    assert two["samples"] == {s.id: s.acceptance_lengths for s in single.last.samples}
    # Rank one logs nothing and keeps no history: only rank zero does.
    other = json.loads((tmp_path / "rank1.json").read_text())
    assert other["logged"] == {} and other["history"] == []


# -- a real transformers.Trainer ----------------------------------------------------------------------

class DraftTraining(nn.Module):
    """A Hugging Face-trainable module: the drafter plus the target's frozen matrices; forward = DFlash loss."""

    def __init__(self, cfg: dict, cache: str) -> None:
        super().__init__()
        from dflash_cb.cache.states import StateCache
        from dflash_cb.core.drafters.layouts import drafter_from_config

        self.drafter = drafter_from_config(cfg)  # DFlash or DFlash 2, as the config says
        head = StateCache(cache).load_head(dtype=torch.float32)
        self.register_buffer("target_embed", head.embed_tokens.clone(), persistent=False)
        self.register_buffer("target_lm_head", head.lm_head.clone(), persistent=False)

    def forward(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        from dflash_cb.cache.states import TargetHead
        from dflash_cb.core.drafters.training import batch_loss

        loss, _ = batch_loss(self.drafter, TargetHead(self.target_embed, self.target_lm_head, tied=False), samples, 8)
        return {"loss": loss}


def hf_train(tmp_path: Path, cache: Path, cfg: dict, max_steps: int, every: int, resume: str | None = None,
             training_args: dict | None = None, eval_dataset: Any = None, **options: Any):
    from transformers import Trainer, TrainingArguments

    from dflash_cb import DFlashEvalTrainerCallback
    from dflash_cb.demo.lightning_module import CachedStatesDataset

    torch.manual_seed(0)
    model = DraftTraining(cfg, str(cache))
    settings = {"output_dir": str(tmp_path / "hf"), "max_steps": max_steps, "per_device_train_batch_size": 2,
                "learning_rate": 1e-2, "lr_scheduler_type": "constant", "report_to": "none", "use_cpu": True,
                "save_strategy": "steps", "save_steps": every, "logging_strategy": "no", "disable_tqdm": True,
                "seed": 0, "remove_unused_columns": False, "dataloader_num_workers": 0}
    args = TrainingArguments(**{**settings, **(training_args or {})})
    trainer = Trainer(model=model, args=args, train_dataset=CachedStatesDataset(str(cache)),
                      eval_dataset=eval_dataset, data_collator=lambda batch: {"samples": batch})
    options.setdefault("console", False)
    extra = options.pop("extra_callbacks", [])
    cb = DFlashEvalTrainerCallback(trainer, states=str(cache), every_n_train_steps=every, drafter="drafter",
                                   ddtree_budgets=BUDGETS, **options)
    trainer.add_callback(cb)
    for make in extra:
        trainer.add_callback(make(trainer))
    initial = {k: v.clone() for k, v in model.drafter.state_dict().items()}
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb, initial


def _evaluations(trainer) -> dict[int, dict[str, float]]:
    return {h["step"]: h for h in trainer.state.log_history if PREFIX + "tau" in h}


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_hf_trainer_logs_the_tools_tau_at_every_evaluated_step(tmp_path, tiny_cache, tiny_drafter_config,
                                                               tiny_dflash2_config, family):
    """The metrics reach ``trainer.state.log_history`` through ``trainer.log``; each equals the tool on the
    checkpoint the Trainer saved at that step (extracted with ``tools/extract_drafter.py``'s code), for a DFlash
    and a DFlash 2 drafter (selector figures included)."""
    from dflash_cb.core.checkpoints.load import extract_drafter
    from dflash_cb.core.drafters.layouts import drafter_from_config

    tiny_drafter_config = tiny_dflash2_config if family == "dflash2" else tiny_drafter_config
    trainer, cb, initial = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=6, every=3)
    logged = _evaluations(trainer)
    assert sorted(logged) == [0, 3, 6] == [h["step"] for h in cb.evaluator.history]
    assert logged[6][PREFIX + "tau"] != logged[0][PREFIX + "tau"]
    first = drafter_from_config(tiny_drafter_config)
    first.load_state_dict(initial)
    first.save_pretrained(tmp_path / "drafter_0")
    assert (PREFIX + "selector/oracle_tau" in logged[6]) == (family == "dflash2")
    for step in (3, 6):
        extract_drafter(tmp_path / "hf" / f"checkpoint-{step}" / "model.safetensors", tmp_path / f"drafter_{step}",
                        config=tiny_drafter_config)
    for step in (0, 3, 6):
        assert_step_equals_tool(tiny_cache, tmp_path / f"drafter_{step}", tmp_path / f"r{step}.json", logged[step],
                                step == 6, tiny_drafter_config["block_size"], step)
    saved = json.loads((tmp_path / "hf" / "checkpoint-6" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["DFlashEvalTrainerCallback"]["attributes"]["evaluator_state"]
    assert [h["step"] for h in state["history"]] == [0, 3, 6] and state["last_eval_step"] == 6


@pytest.mark.e2e
def test_hf_trainer_resume_neither_repeats_nor_skips(tmp_path, tiny_cache, tiny_drafter_config):
    trainer, cb, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=5, every=2, eval_on_fit_end=False)
    assert sorted(_evaluations(trainer)) == [0, 2, 4]
    resumed, cb2, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=8, every=2,
                               resume=str(tmp_path / "hf" / "checkpoint-4"))
    assert [h["step"] for h in cb2.evaluator.history] == [0, 2, 4, 6, 8] and cb2.evaluator.state.num_evals == 5
    # The resumed Trainer's log history (restored from the checkpoint) has each step once.
    steps = [h["step"] for h in resumed.state.log_history if PREFIX + "tau" in h]
    assert steps == [0, 2, 4, 6, 8]
    # transformers' own restore rebuilds callbacks from their JSON arguments, without the trainer: one clear line.
    with pytest.raises(DFlashCBError, match="leave that option False"):
        hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=8, every=2, eval_on_fit_end=False,
                 resume=str(tmp_path / "hf" / "checkpoint-4"),
                 training_args={"restore_callback_states_from_checkpoint": True})


@pytest.mark.e2e
def test_hf_run_reporting_to_tensorboard_gets_the_evaluators_names_and_the_rich_record(tmp_path, tiny_cache,
                                                                                      tiny_drafter_config):
    """``report_to=["tensorboard"]``: the Trainer's own TensorBoard writer gets the scalars under the evaluator's
    names and step (not renamed ``train/...``), the histogram, the per-depth chart and the sample table."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, cb, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=4, every=2, table_samples=2,
                              training_args={"report_to": ["tensorboard"]})
    (events,) = list((tmp_path / "hf").glob("runs/*"))
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    steps = sorted(_evaluations(trainer))
    assert [e.step for e in acc.Scalars(PREFIX + "tau")] == steps == [0, 2, 4]
    assert not any(t.startswith("train/" + PREFIX) for t in tags["scalars"])
    assert [e.step for e in acc.Histograms(PREFIX + "produced_hist")] == steps
    assert [e.step for e in acc.Images(PREFIX + "charts/acceptance_per_depth")] == steps
    assert PREFIX + "sample_table/text_summary" in tags["tensors"]


@pytest.mark.e2e
def test_hf_run_reporting_to_mlflow_gets_the_scalars_and_the_record_as_artifacts(tmp_path, tiny_cache,
                                                                                 tiny_drafter_config, mlflow_store):
    """``report_to=["mlflow"]`` (a local file store): the Trainer's ``MLflowCallback`` gets the scalars (through
    the Trainer's log), and the MLflow sink adds the chart and the sample table to the same, active run."""
    from mlflow import MlflowClient

    trainer, cb, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=4, every=2, table_samples=2,
                              training_args={"report_to": ["mlflow"]})
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    steps = sorted(_evaluations(trainer))
    assert [m.step for m in client.get_metric_history(run.info.run_id, PREFIX + "tau")] == steps == [0, 2, 4]
    chart = PREFIX + "charts/acceptance_per_depth"
    assert sorted(f.path for f in client.list_artifacts(run.info.run_id, chart)) == [
        f"{chart}/step_{s:07d}.png" for s in steps]
    assert len(client.list_artifacts(run.info.run_id, PREFIX + "sample_table")) == len(steps)


@pytest.mark.e2e
def test_hf_run_reporting_to_wandb_gets_working_panels_and_one_console_line(tmp_path, tiny_cache,
                                                                              tiny_drafter_config, monkeypatch,
                                                                              capsys):
    """A Trainer with ``report_to="wandb"`` (offline): the evaluator's series sit in the run under their own
    names and step axis, so the panels tool, given only the run, finds every panel's keys; the console
    gets one line per evaluation; ``--show`` prints the series."""
    import wandb

    from dflash_cb.integrations.tracking import panels

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "dflash-cb-test")
    trainer, cb, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=6, every=3, console=True,
                              table_samples=2, training_args={"report_to": "wandb", "run_name": "hf",
                                                              "logging_strategy": "steps", "logging_steps": 1})
    run_dir = Path(wandb.run.dir).parent
    wandb.finish()
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "dflash_eval" in ln or "DFlashEvalTrainerCallback" in ln]
    assert [ln.split(":")[0] for ln in lines if " step " in ln] == [
        "DFlashEvalTrainerCallback step 0", "DFlashEvalTrainerCallback step 3", "DFlashEvalTrainerCallback step 6"]
    assert not any("'dflash_eval/" in ln for ln in out.splitlines())  # no dict of every key
    from wandb_runs import history_and_summary

    rows, summary, _ = history_and_summary(run_dir)
    taus = [r for r in rows if PREFIX + "tau" in r]
    assert [r["trainer/global_step"] for r in taus] == [0, 3, 6]  # every tau row has the panels' x-axis
    assert not any(k.startswith("train/" + PREFIX) for r in rows for k in r)  # not renamed by the integration
    assert summary[PREFIX + "best/tau"] == max(r[PREFIX + "tau"] for r in taus)
    assert any(k.startswith(PREFIX + "sample_table") for r in rows for k in r)
    # The Trainer's own record still has them (log_history, trainer_state.json).
    assert sorted(_evaluations(trainer)) == [0, 3, 6]
    assert panels.main(["--run", str(run_dir), "--dry-run", "--entity", "e", "--project", "p"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err, err
    assert panels.main(["--run", str(run_dir), "--show"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("config dflash_eval_config: ") and str(tiny_cache) in shown[0]
    shown = [ln for ln in shown if not ln.startswith("config ")]
    shown = shown[:next(i for i, ln in enumerate(shown) if ln.startswith("every key logged"))]  # the series table
    assert shown[0].split()[:2] == ["step", "tau"] and [ln.split()[0] for ln in shown[1:]] == ["0", "3", "6"]
    assert shown[1].split()[1] == f"{taus[0][PREFIX + 'tau']:.4f}"


def _two_callbacks(trainer):
    from dflash_cb import DFlashEvalTrainerCallback

    return DFlashEvalTrainerCallback(trainer, states=trainer.train_dataset.states, every_n_train_steps=2,
                                     drafter="drafter", ddtree_budgets=[4], console=False, prefix="b/",
                                     eval_on_fit_end=False)


@pytest.mark.e2e
def test_hf_two_callbacks_resume_each_from_their_latest_state(tmp_path, tiny_cache, tiny_drafter_config):
    first, cb_a, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=5, every=2, prefix="a/",
                              eval_on_fit_end=False, extra_callbacks=[_two_callbacks])
    cb_b = next(c for c in first.callback_handler.callbacks if getattr(c, "config", None) and c.config.prefix == "b/")
    assert [h["step"] for h in cb_a.evaluator.history] == [0, 2, 4] == [h["step"] for h in cb_b.evaluator.history]
    resumed, cb_a2, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=8, every=2, prefix="a/",
                                 resume=str(tmp_path / "hf" / "checkpoint-4"), extra_callbacks=[_two_callbacks])
    cb_b2 = next(c for c in resumed.callback_handler.callbacks
                 if getattr(c, "config", None) and c.config.prefix == "b/")
    assert [h["step"] for h in cb_a2.evaluator.history] == [0, 2, 4, 6, 8]
    assert [h["step"] for h in cb_b2.evaluator.history] == [0, 2, 4, 6, 8]


@pytest.mark.e2e
@pytest.mark.parametrize("spelling", ["trailing slash", "relative"])
def test_hf_resume_finds_the_state_whatever_the_spelling_of_the_cache(tmp_path, tiny_cache, tiny_drafter_config,
                                                                      monkeypatch, spelling):
    hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=5, every=2, eval_on_fit_end=False)
    if spelling == "relative":
        monkeypatch.chdir(tiny_cache.parent)
        states = Path(tiny_cache.name)
    else:
        states = Path(str(tiny_cache) + "/")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "new series" warning either
        _, cb, _ = hf_train(tmp_path, Path(str(states)), tiny_drafter_config, max_steps=8, every=2,
                            resume=str(tmp_path / "hf" / "checkpoint-4"))
    assert [h["step"] for h in cb.evaluator.history] == [0, 2, 4, 6, 8]


@pytest.mark.e2e
def test_hf_second_train_on_the_same_trainer_starts_a_new_series(tmp_path, tiny_cache, tiny_drafter_config):
    trainer, cb, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=4, every=2)
    assert [h["step"] for h in cb.evaluator.history] == [0, 2, 4]
    with pytest.warns(RuntimeWarning, match="a new series starts"):
        trainer.train()
    assert [h["step"] for h in cb.evaluator.history] == [0, 2, 4]  # not [0, 2, 4, 2, 4]
    assert cb.evaluator.state.num_evals == 3


@pytest.mark.e2e
def test_two_callbacks_with_one_prefix_are_refused_naming_it(tmp_path, tiny_cache, tiny_drafter_config):
    from lightning.pytorch import Trainer

    from dflash_cb import DFlashEvalCallback, DFlashEvalTrainerCallback

    def same_prefix(trainer):
        return DFlashEvalTrainerCallback(trainer, states=str(tiny_cache), drafter="drafter")

    with pytest.raises(DFlashCBError, match=r"two callbacks with prefix='dflash_eval/'.*own prefix="):
        hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=2, every=2, extra_callbacks=[same_prefix])
    # Lightning refuses two callbacks with one state key when the Trainer is built; the state key is the prefix.
    with pytest.raises(RuntimeError, match="state_key"):
        Trainer(callbacks=[DFlashEvalCallback(states=str(tiny_cache)), DFlashEvalCallback(states="elsewhere")],
                logger=False)
    Trainer(callbacks=[DFlashEvalCallback(states=str(tiny_cache)),
                       DFlashEvalCallback(states=str(tiny_cache), prefix="b/")], logger=False)


@pytest.mark.e2e
def test_hf_keeps_the_checkpoint_with_the_best_tau_of_its_own_step(tmp_path, tiny_cache, tiny_drafter_config):
    """``metric_for_best_model="dflash_eval/tau"`` with the Trainer's evaluations every 3 steps and the
    callback's every 2: at each Trainer evaluation the callback supplies that step's tau."""
    from dflash_cb.demo.lightning_module import CachedStatesDataset

    trainer, cb, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=6, every=2, training_args={
        "eval_strategy": "steps", "eval_steps": 3, "save_strategy": "best", "save_steps": 3,
        "metric_for_best_model": PREFIX + "tau", "greater_is_better": True, "per_device_eval_batch_size": 2},
        eval_dataset=CachedStatesDataset(str(tiny_cache)))
    by_step = {h["step"]: h["tau"] for h in cb.evaluator.history}
    assert {3, 6} <= set(by_step)  # the Trainer's evaluation steps were measured
    best_step = int(Path(trainer.state.best_model_checkpoint).name.split("-")[1])
    assert trainer.state.best_metric == by_step[best_step] == max(by_step[3], by_step[6])


# -- the documented snippets, one per loop (docs/training-loops.md) ----------------------------------------------------------------

def doc_snippet(title: str) -> str:
    """The first Python block under ``title`` in docs/training-loops.md."""
    text = (ROOT / "docs" / "training-loops.md").read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(title):], re.S).group(1)


def run_doc_snippet(title: str, tmp_path: Path, cache: Path, cfg: dict, monkeypatch, seed: int = 0,
                    code: str | None = None) -> dict[str, Any]:
    """The snippet under ``title`` as printed (or ``code``), its settings lines pointed at the test cache and
    drafter, run after ``torch.manual_seed(seed)``."""
    from dflash_cb import DFlashDrafter

    code = doc_snippet(title) if code is None else code
    (tmp_path / "drafter_config.json").write_text(json.dumps(cfg))
    DFlashDrafter.from_config_dict(cfg).save_pretrained(tmp_path / "start")
    settings = {"TRAIN": str(cache), "STATES": str(cache), "CONFIG": str(tmp_path / "drafter_config.json"),
                "DRAFTER": str(tmp_path / "start"), "STEPS": 4, "EVERY": 2}
    for name, value in settings.items():
        code, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", code, flags=re.M)
        assert n <= 1, name
    assert "demo_out" not in code  # every path of the snippet is a settings line
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "readme"}
    torch.manual_seed(seed)
    exec(compile(code, f"docs/training-loops.md ({title})", "exec"), namespace)
    return namespace


@pytest.mark.e2e
def test_documented_plain_loop_snippet_runs(tmp_path, tiny_cache, tiny_drafter_config, monkeypatch, capsys):
    from dflash_cb import DFlashDrafter
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli import extract as extract_cli

    ns = run_doc_snippet("## A plain PyTorch loop", tmp_path, tiny_cache, tiny_drafter_config, monkeypatch)
    assert [h["step"] for h in ns["evaluator"].history] == [0, 2, 4]
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["dflash_eval"]["last_eval_step"] == 4 and saved["step"] == 4
    # The plain loop's checkpoint gives its drafter back (the config from --config, as the loop read it).
    capsys.readouterr()
    assert run(extract_cli.main, ["--ckpt", str(tmp_path / "checkpoint.pt"), "--out", str(tmp_path / "out"),
                                  "--config", str(tmp_path / "drafter_config.json")]) == 0
    line = capsys.readouterr().out
    assert "from entry 'drafter'" in line and "dropped dflash_eval, optimizer, step" in line
    got = DFlashDrafter.from_pretrained(tmp_path / "out")
    for k, v in ns["drafter"].state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.e2e
def test_extract_from_a_hugging_face_checkpoint_folder(tmp_path, tiny_cache, tiny_drafter_config, capsys):
    """``--ckpt hf_out/checkpoint-N``: the folder the Trainer writes; the summary names what was left behind."""
    import json as _json

    from dflash_cb import DFlashDrafter
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli import extract as extract_cli

    trainer, _, _ = hf_train(tmp_path, tiny_cache, tiny_drafter_config, max_steps=3, every=3)
    (tmp_path / "cfg.json").write_text(_json.dumps(tiny_drafter_config))
    capsys.readouterr()
    assert run(extract_cli.main, ["--ckpt", str(tmp_path / "hf" / "checkpoint-3"), "--out", str(tmp_path / "d"),
                                  "--config", str(tmp_path / "cfg.json")]) == 0
    line = capsys.readouterr().out
    assert "prefix 'drafter.'" in line and "fc.weight" not in line.split("from")[1]
    got = DFlashDrafter.from_pretrained(tmp_path / "d")
    for k, v in trainer.model.drafter.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    # Without --config: one line naming the fix.
    assert run(extract_cli.main, ["--ckpt", str(tmp_path / "hf" / "checkpoint-3"), "--out", str(tmp_path / "e")]) == 2
    assert "pass --config" in capsys.readouterr().err


@pytest.mark.e2e
def test_documented_lightning_module_snippet_runs_and_extracts_without_config(tmp_path, tiny_cache, tiny_drafter_config,
                                                                          monkeypatch):
    """The documented LightningModule trains with the callback, and its checkpoint
    carries the drafter config, so extract_drafter needs no --config."""
    from dflash_cb.core.checkpoints.load import extract_drafter
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    ns = run_doc_snippet("### Your own LightningModule", tmp_path, tiny_cache, tiny_drafter_config,
                            monkeypatch)
    assert [h["step"] for h in ns["callback"].history] == [0, 2, 4]
    ns["trainer"].save_checkpoint(tmp_path / "last.ckpt")
    extract_drafter(tmp_path / "last.ckpt", tmp_path / "extracted")
    got = DFlashDrafter.from_pretrained(tmp_path / "extracted")
    for k, v in ns["module"].drafter.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.e2e
def test_documented_hf_trainer_snippet_runs_and_is_seeded(tmp_path, tiny_cache, tiny_drafter_config, monkeypatch):
    """Run twice from two different global seeds, the snippet trains the same drafter (it seeds the drafter's
    initial weights before building it, and the Trainer's data order): the example's numbers are reproducible."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = run_doc_snippet("## Hugging Face `Trainer`", tmp_path / "a", tiny_cache, tiny_drafter_config,
                            monkeypatch, seed=1)
    assert sorted(_evaluations(first["trainer"])) == [0, 2, 4]
    second = run_doc_snippet("## Hugging Face `Trainer`", tmp_path / "b", tiny_cache, tiny_drafter_config,
                             monkeypatch, seed=2)
    a, b = first["model"].drafter.state_dict(), second["model"].drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["tau"] for h in first["callback"].evaluator.history] == [
        h["tau"] for h in second["callback"].evaluator.history]


@pytest.mark.e2e
def test_documented_hf_best_checkpoint_recipe_runs(tmp_path, tiny_cache, tiny_drafter_config, monkeypatch):
    """The best-checkpoint recipe (its own block, replacing the snippet's last lines from ``args = ``): with the
    eval_dataset it names, the Trainer keeps the checkpoint whose step had the best tau."""
    code = doc_snippet("## Hugging Face `Trainer`")
    best = textwrap.dedent(doc_snippet("**Best checkpoint by tau.**"))  # a block inside a list item
    assert "eval_dataset=CachedStatesDataset(STATES)" in best
    ns = run_doc_snippet("## Hugging Face `Trainer`", tmp_path, tiny_cache, tiny_drafter_config, monkeypatch,
                         code=code[:code.index("args = TrainingArguments(")] + best)
    trainer, history = ns["trainer"], ns["callback"].evaluator.history
    by_step = {h["step"]: h["tau"] for h in history}
    best_step = int(Path(trainer.state.best_model_checkpoint).name.split("-")[1])
    assert trainer.state.best_metric == by_step[best_step] == max(by_step[s] for s in (2, 4))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
