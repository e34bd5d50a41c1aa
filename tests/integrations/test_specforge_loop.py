"""SpecForge 0.2.0's own training loop with the live evaluation attached (``dflash_cb.integrations.loops.specforge``).

In process: SpecForge's ``TrainerController.fit`` over its ``TrainerCore``, ``DFlashTrainStrategy``,
``OnlineDFlashModel`` and ``DFlashDraftModel``, its own ``FSDPTrainingBackend`` (unwrapped: one CPU process) and
``BF16Optimizer`` (AdamW over float32 masters, here over float32 weights), ``sdpa`` attention, one
``TrainBatch`` per sample of the tiny cache. As a user runs it: SpecForge's command line (``specforge train``,
offline features written from the same cache) through ``tools/specforge_train.py``, in real subprocesses, also
as two torchrun ranks.

Claims: the tau logged through SpecForge's logger at step 0, at a periodic step and at fit end equals
``tools/eval_drafter.py`` on the weights of that step (saved with SpecForge's ``save_pretrained``, or exported
with ``specforge export --to hf``); SpecForge keeps the checkpoint with the best logged tau when asked; a
resume from a SpecForge checkpoint neither repeats nor skips an evaluation; two attachments with one prefix
are refused.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from oracles import require
from tool_runs import BUDGETS, PREFIX, assert_logged_equals_tool, assert_step_equals_tool, tool_metrics
from torch import nn

from dflash_cb.common.errors import DFlashCBError

require("specforge.training.controller")  # the oracle: a missing SpecForge fails here, never skips
from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel  # noqa: E402
from specforge.modeling.draft.dflash import DFlashDraftModel  # noqa: E402
from specforge.optimizer import BF16Optimizer  # noqa: E402
from specforge.training.backend import FSDPTrainingBackend, ParallelConfig  # noqa: E402
from specforge.training.checkpoint import CheckpointManager  # noqa: E402
from specforge.training.controller import TrainerController, TrainerCore  # noqa: E402
from specforge.training.strategies.base import DFlashTrainStrategy  # noqa: E402

from dflash_cb.integrations.loops.specforge import STATE_FILE, attach  # noqa: E402
from dflash_cb.integrations.loops.specforge_data import train_batches, write_offline_features  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TAU = PREFIX + "tau"
RUN = "run"


# -- SpecForge's loop on the tiny cache ----------------------------------------------------------------

@pytest.fixture(autouse=True)
def one_rank():
    """A one-process gloo group, as SpecForge's command line always has (its optimizer's resume needs one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def specforge_controller(cache_dir: Path, cfg: dict, out: Path, *, max_steps: int, logger: Any = None,
                         resume: Path | None = None, draft_class: type = DFlashDraftModel,
                         online_class: type = OnlineDFlashModel, strategy_class: type = DFlashTrainStrategy,
                         **controller_args: Any) -> tuple[TrainerController, nn.Module]:
    """SpecForge's controller over its own pieces, built as its ``Trainer`` builds them (resume: the draft weights
    before the backend, the optimizer and RNG state after, the position in the data from the checkpoint); its
    DFlash family by default, another (Domino, DSpark) by its draft model, online model and strategy classes."""
    from transformers import Qwen3Config

    from dflash_cb.cache.states import StateCache

    torch.manual_seed(0)
    sf_cfg = Qwen3Config(**cfg)
    sf_cfg._attn_implementation = "sdpa"
    draft = draft_class(sf_cfg)
    head = StateCache(cache_dir).load_head()
    lm_head = nn.Linear(head.lm_head.shape[1], head.lm_head.shape[0], bias=False)
    lm_head.weight.data.copy_(head.lm_head)
    lm_head.requires_grad_(False)
    embed = nn.Embedding.from_pretrained(head.embed_tokens.clone())
    model = online_class(draft, lm_head, embed, cfg["dflash_config"]["mask_token_id"],
                         block_size=cfg["block_size"], attention_backend="sdpa", num_anchors=64)
    backend = FSDPTrainingBackend(ParallelConfig(), optimizer_factory=lambda m: BF16Optimizer(
        m, lr=3e-2, total_steps=100, warmup_ratio=0.0, lr_scheduler="constant"))
    position: dict[str, int] = {}
    state = None
    if resume is not None:
        state = CheckpointManager.read_resume_state(str(resume))
        draft.load_state_dict(state["draft_state_dict"])
        samples = int(state["epoch_samples"])
        position = {"start_step": state["global_step"], "start_epoch": state["epoch"], "start_batch": samples,
                    "start_samples": samples}
    backend.prepare_model(model, wrap=False, optimizer_target=draft)
    if state is not None:
        backend.load_state_dict(state["backend"])
    core = TrainerCore(strategy_class(model), backend)
    controller = TrainerController(core, run_id=RUN, output_dir=str(out), max_steps=max_steps, num_epochs=50,
                                   log_interval=1, logger=logger, **position, **controller_args)
    return controller, draft


class Log:
    """SpecForge's ``logger(metrics, step)``: every call kept; the evaluations (calls with the tau) by step."""

    def __init__(self, save_drafter_to: Path | None = None, drafter: nn.Module | None = None) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []
        self.save_to, self.drafter = save_drafter_to, drafter

    def __call__(self, metrics: dict[str, Any], step: int) -> None:
        self.calls.append((step, dict(metrics)))
        if TAU in metrics and self.save_to is not None and not (self.save_to / f"drafter_{step}").exists():
            self.drafter.save_pretrained(self.save_to / f"drafter_{step}")  # the weights this tau measured

    def evaluations(self) -> dict[int, dict[str, Any]]:
        """The evaluator's own calls (a SpecForge evaluation repeats them with its eval/ metrics)."""
        out: dict[int, dict[str, Any]] = {}
        for step, m in self.calls:
            if TAU in m and not any(k.startswith("eval/") for k in m):
                assert step not in out, f"two evaluations logged at step {step}"
                out[step] = m
        return out

    def specforge_evaluations(self) -> dict[int, dict[str, Any]]:
        return {step: m for step, m in self.calls if "eval/simulated_acc_len" in m}


@pytest.mark.e2e
def test_logged_tau_equals_the_tool_at_start_periodic_step_and_fit_end(tmp_path, tiny_cache, tiny_drafter_config):
    log = Log(tmp_path)
    controller, draft = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=6,
                                             logger=log)
    log.drafter = draft
    attachment = attach(controller, tiny_cache, every_n_train_steps=3, ddtree_budgets=BUDGETS, console=False)
    assert controller.fit(train_batches(tiny_cache)) == 6
    logged = log.evaluations()
    assert sorted(logged) == [0, 3, 6] == [h["step"] for h in attachment.evaluator.history]
    assert logged[6][TAU] != logged[0][TAU]  # it trained between the evaluations
    assert {3, 6} <= {step for step, m in log.calls if "loss" in m}  # SpecForge's own metrics, same step axis
    for step in (0, 3, 6):
        assert_step_equals_tool(tiny_cache, tmp_path / f"drafter_{step}", tmp_path / f"r{step}.json", logged[step],
                                step == 6, tiny_drafter_config["block_size"], step)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["checkpoint_manager", "keep_best_by_tau"])
def test_specforge_keeps_the_checkpoint_with_the_best_logged_tau(tmp_path, tiny_cache, tiny_drafter_config, how):
    """At each of SpecForge's evaluations (every 2 steps) its eval metrics carry that step's tau, measured then
    (the evaluator's own schedule is off), and its checkpoint manager keeps the best by it."""
    out = tmp_path / "out"
    batches = train_batches(tiny_cache)
    extra = {"checkpoint_manager": CheckpointManager(str(out), RUN, best_metric=TAU)} if how == "checkpoint_manager" \
        else {}
    log = Log()
    controller, _ = specforge_controller(tiny_cache, tiny_drafter_config, out, max_steps=10, logger=log,
                                         eval_interval=2, eval_data_factory=lambda: batches[:2], **extra)
    attach(controller, tiny_cache, every_n_train_steps=0, eval_on_fit_end=False, ddtree_budgets=[4], console=False,
           keep_best_by_tau=how == "keep_best_by_tau")
    controller.fit(batches)
    theirs = log.specforge_evaluations()
    assert sorted(theirs) == [2, 4, 6, 8, 10] and sorted(log.evaluations()) == [0, 2, 4, 6, 8, 10]
    taus = {step: m[TAU] for step, m in theirs.items()}
    assert all(log.evaluations()[s][TAU] == tau for s, tau in taus.items())  # measured once, logged with both
    assert len(set(taus.values())) > 1, taus  # the choice carries information
    best = max(sorted(taus), key=lambda s: taus[s])  # the first of equal bests: SpecForge needs a strict gain
    meta = json.loads((out / f"{RUN}.best_meta.json").read_text())
    assert meta["metric"] == TAU and meta["step"] == best and meta["score"] == taus[best]
    assert os.path.realpath(out / f"{RUN}-best") == str((out / f"{RUN}-step{best}").resolve())
    saved = json.loads((out / f"{RUN}-step{best}" / STATE_FILE).read_text())[PREFIX]
    assert saved["history"][-1]["step"] == best and saved["history"][-1]["tau"] == taus[best]


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["its own folder", "resume_from"])
def test_resume_from_a_specforge_checkpoint_neither_repeats_nor_skips(tmp_path, tiny_cache, tiny_drafter_config,
                                                                     where):
    batches = train_batches(tiny_cache)
    first_log = Log()
    first, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=5, logger=first_log,
                                    save_interval=2)
    attach(first, tiny_cache, every_n_train_steps=2, eval_on_fit_end=False, ddtree_budgets=[4], console=False)
    first.fit(batches)
    assert sorted(first_log.evaluations()) == [0, 2, 4]
    checkpoint = tmp_path / "out" / f"{RUN}-step4"
    out, resume_from = tmp_path / "out", None
    if where == "resume_from":  # resumed into another output folder: the saved state is read where it was resumed from
        resume_from = tmp_path / "moved" / checkpoint.name
        shutil.copytree(checkpoint, resume_from)
        out, checkpoint = tmp_path / "out2", resume_from
    log = Log()
    resumed, _ = specforge_controller(tiny_cache, tiny_drafter_config, out, max_steps=8, logger=log,
                                      resume=checkpoint, save_interval=2)
    attachment = attach(resumed, tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], console=False,
                        resume_from=resume_from)
    resumed.fit(batches)
    assert sorted(log.evaluations()) == [6, 8]  # no second start evaluation, no second step 4
    assert [h["step"] for h in attachment.evaluator.history] == [0, 2, 4, 6, 8]
    assert attachment.evaluator.state.num_evals == 5
    saved = json.loads((out / f"{RUN}-step8" / STATE_FILE).read_text())[PREFIX]
    assert [h["step"] for h in saved["history"]] == [0, 2, 4, 6, 8]


@pytest.mark.e2e
def test_resume_without_a_saved_state_says_so_and_evaluates_the_resumed_weights(tmp_path, tiny_cache,
                                                                               tiny_drafter_config):
    batches = train_batches(tiny_cache)
    first, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=2, save_interval=2)
    first.fit(batches)  # trained without the evaluation: its checkpoint has no evaluator state
    log = Log()
    resumed, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=4, logger=log,
                                      resume=tmp_path / "out" / f"{RUN}-step2")
    attach(resumed, tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], console=False)
    with pytest.warns(RuntimeWarning, match=rf"no evaluator state for prefix='dflash_eval/' in .*{RUN}-step2"):
        resumed.fit(batches)
    assert sorted(log.evaluations()) == [2, 4]


@pytest.mark.e2e
def test_two_attachments_with_one_prefix_are_refused_naming_it(tmp_path, tiny_cache, tiny_drafter_config):
    log = Log()
    controller, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=2, logger=log)
    a = attach(controller, tiny_cache, every_n_train_steps=1, ddtree_budgets=[4], console=False)
    with pytest.raises(DFlashCBError, match=r"prefix='dflash_eval/'.*own prefix="):
        attach(controller, tiny_cache, every_n_train_steps=1)
    b = attach(controller, tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], console=False, prefix="b/")
    with pytest.raises(DFlashCBError, match="detach the later attachment first"):
        a.detach()
    controller.fit(train_batches(tiny_cache))
    assert [h["step"] for h in a.evaluator.history] == [0, 1, 2] and [h["step"] for h in b.evaluator.history] == [0, 2]
    b.detach()
    a.detach()
    assert not {"fit", "evaluate_configured", "save_checkpoint"} & set(vars(controller))
    assert "train_step" not in vars(controller.core)  # SpecForge's own methods again
    attach(controller, tiny_cache)  # the prefix is free again


def test_bad_arguments_are_refused_at_attach(tmp_path, tiny_cache, tiny_drafter_config):
    controller, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=2)
    with pytest.raises(DFlashCBError, match=r"keep_best_by_tau=True: .*eval_interval=0.*eval_data_factory=None"):
        attach(controller, tiny_cache, keep_best_by_tau=True)
    with pytest.raises(DFlashCBError, match="unknown evaluator option.s. ddtree_budget;"):
        attach(controller, tiny_cache, ddtree_budget=[4])
    with pytest.raises(DFlashCBError, match="every_n_train_steps=2.5"):
        attach(controller, tiny_cache, every_n_train_steps=2.5)
    with pytest.raises(DFlashCBError, match="expected SpecForge 0.2.0's TrainerController"):
        attach(controller.core, tiny_cache)
    assert not set(vars(controller)) & {"fit", "save_checkpoint"}  # nothing was wrapped


@pytest.mark.e2e
def test_a_resume_from_that_is_no_checkpoint_folder_is_refused_at_attach(tmp_path, tiny_cache, tiny_drafter_config):
    """A folder that does not exist started a new series with a warning (a typo lost the run's history); the
    state file instead of its folder failed at the first fit with the path doubled (NotADirectoryError)."""
    from dflash_cb.integrations.loops.specforge import STATE_FILE

    controller, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=2)
    missing = tmp_path / "out" / f"{RUN}-step4"
    with pytest.raises(DFlashCBError, match=rf"resume_from={re.escape(str(missing))}: no such folder"):
        attach(controller, tiny_cache, resume_from=missing)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / STATE_FILE).write_text("{}")
    with pytest.raises(DFlashCBError, match=rf"the evaluator's state file; give its folder, resume_from="
                                            rf"{re.escape(str(folder))}$"):
        attach(controller, tiny_cache, resume_from=folder / STATE_FILE)
    assert not set(vars(controller)) & {"fit", "save_checkpoint"}  # nothing was wrapped
    attach(controller, tiny_cache, resume_from=folder).detach()  # a checkpoint folder is taken


# -- SpecForge's command line, as a user runs it ------------------------------------------------------------

def write_specforge_run(root: Path, cache_dir: Path, cfg: dict, ranks: int = 1, eval_set: bool = True,
                        **training: Any) -> Path:
    """SpecForge's offline features written from the cache, the drafter's config and a run config."""
    import yaml

    feats = root / "features"
    write_offline_features(cache_dir, feats)
    (root / "draft.json").write_text(json.dumps(cfg))
    (root / "eval.yaml").write_text("ddtree_budgets: [4, 8]\nconsole: true\n")
    run = {"run_id": RUN, "output_dir": str(root / "out"),
           "model": {"target_model_path": str(cache_dir.parent / "target"),
                     "draft_model_config": str(root / "draft.json"), "torch_dtype": "float32"},
           "data": {"hidden_states_path": str(feats), "eval_hidden_states_path": str(feats) if eval_set else "",
                    "dataloader_num_workers": 0},
           "training": {"strategy": "dflash", "batch_size": 1, "attention_backend": "sdpa", "num_anchors": 64,
                        "learning_rate": 3e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "log_interval": 1,
                        "fsdp_sharding": "NO_SHARD", "num_epochs": 10, **training},
           "deployment": {"trainer": {"nproc_per_node": ranks}}}
    (root / "run.yaml").write_text(yaml.safe_dump(run))
    return root / "run.yaml"


def specforge_train(root: Path, cache_dir: Path, *args: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    ours = ["--states", str(cache_dir), "--every-n-train-steps", "2", "--eval-config", str(root / "eval.yaml"),
            "--keep-best-by-tau"]
    # Each rank's output to its own file (SpecForge's console logger prints on every rank).
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
                "--standalone", "--log-dir", str(root / "ranks"), "--redirects", "3"] \
        if torchrun else [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*launcher, str(ROOT / "tools" / "specforge_train.py"), *ours, "--",
                           "--config", str(root / "run.yaml"), *args],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600)


def logged_lines(stdout: str) -> list[tuple[int, dict[str, float]]]:
    """SpecForge's console logger: ``step N: {metrics}`` per call."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("step ") and ": {" in line:
            head, body = line.split(": ", 1)
            out.append((int(head.split()[1]), ast.literal_eval(body)))
    return out


def evaluations(stdout: str) -> dict[int, dict[str, float]]:
    return {step: m for step, m in logged_lines(stdout) if TAU in m and not any(k.startswith("eval/") for k in m)}


def export_and_score(root: Path, cache_dir: Path, step: int, block_size: int) -> dict[str, Any]:
    """SpecForge's own export of its checkpoint at ``step`` (``specforge export --to hf``), scored by the tool."""
    from specforge.export.to_hf import export_to_hf

    folder = root / f"exported_{step}"
    export_to_hf(str(root / "out" / f"{RUN}-step{step}"), str(root / "draft.json"), str(folder))
    return tool_metrics(cache_dir, folder, root / f"r{step}.json", light=False, block_size=block_size)


@pytest.mark.e2e
def test_specforge_command_line_with_the_evaluation_attached(tmp_path, tiny_cache, tiny_drafter_config):
    """``specforge train`` through the launcher: evaluations at 0, 2, 4; resumed (``training.resume_from``) to
    step 8: 6 and 8 only; the best checkpoint by tau; the fit-end tau equals the tool on SpecForge's export."""
    write_specforge_run(tmp_path, tiny_cache, tiny_drafter_config, max_steps=4, total_steps=8, eval_interval=2,
                        save_interval=2)
    first = specforge_train(tmp_path, tiny_cache)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert sorted(evaluations(first.stdout)) == [0, 2, 4]
    assert "SpecForgeEvaluation step 4: tau" in first.stdout  # the evaluator's console line
    second = specforge_train(tmp_path, tiny_cache, f"training.resume_from={tmp_path / 'out' / f'{RUN}-step4'}",
                             "training.max_steps=8")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    logged = evaluations(second.stdout)
    assert sorted(logged) == [6, 8]
    saved = json.loads((tmp_path / "out" / f"{RUN}-step8" / STATE_FILE).read_text())[PREFIX]
    assert [h["step"] for h in saved["history"]] == [0, 2, 4, 6, 8]
    taus = {h["step"]: h["tau"] for h in saved["history"] if h["step"] > 0}  # SpecForge evaluates at 2, 4, 6, 8
    best = max(sorted(taus), key=lambda s: taus[s])
    meta = json.loads((tmp_path / "out" / f"{RUN}.best_meta.json").read_text())
    assert (meta["metric"], meta["step"], meta["score"]) == (TAU, best, taus[best])
    expected = export_and_score(tmp_path, tiny_cache, 8, tiny_drafter_config["block_size"])
    assert_logged_equals_tool(logged[8], expected, 8, prefix=PREFIX + "full/")  # the fit end: full


@pytest.mark.e2e
def test_specforge_command_line_on_two_torchrun_ranks(tmp_path, tiny_cache, tiny_drafter_config):
    """Two gloo ranks (torchrun; SpecForge's DDP backend): every rank evaluates its share, rank zero logs,
    and the fit-end numbers equal the tool on the weights SpecForge saved."""
    write_specforge_run(tmp_path, tiny_cache, tiny_drafter_config, ranks=2, max_steps=4, eval_interval=2,
                        save_interval=4)
    done = specforge_train(tmp_path, tiny_cache, torchrun=2)
    outputs = [next((tmp_path / "ranks").rglob(f"attempt_0/{rank}/stdout.log")).read_text() for rank in (0, 1)]
    errors = [p.read_text()[-2000:] for p in sorted((tmp_path / "ranks").rglob("attempt_0/*/stderr.log"))]
    assert done.returncode == 0, outputs[0][-2000:] + "\n".join(errors) + done.stderr[-2000:]
    logged = evaluations(outputs[0])
    assert sorted(logged) == [0, 2, 4] and evaluations(outputs[1]) == {}  # rank zero logs, once each
    expected = export_and_score(tmp_path, tiny_cache, 4, tiny_drafter_config["block_size"])
    assert_logged_equals_tool(logged[4], expected, 4, prefix=PREFIX + "full/")  # the fit end: full


@pytest.mark.e2e
def test_specforge_command_line_refuses_what_it_cannot_do_in_one_line(tmp_path, tiny_cache, tiny_drafter_config,
                                                                      capsys):
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli.specforge_train import main

    assert run(main, ["--states", str(tiny_cache)]) == 2
    assert "put SpecForge's train arguments after --" in capsys.readouterr().err
    write_specforge_run(tmp_path, tiny_cache, tiny_drafter_config, ranks=2, eval_interval=2, max_steps=2)
    # Two ranks without torchrun: SpecForge would start workers without the evaluation.
    assert run(main, ["--states", str(tiny_cache), "--", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "torchrun --nproc_per_node N" in err and len(err.splitlines()) == 1
    (tmp_path / "eval.yaml").write_text("ddtree_budget: [4]\n")
    assert run(main, ["--states", str(tiny_cache), "--eval-config", str(tmp_path / "eval.yaml"), "--",
                      "--config", str(tmp_path / "run.yaml")]) == 2
    assert "unknown evaluator option(s) ddtree_budget" in capsys.readouterr().err
    # --keep-best-by-tau without SpecForge's own evaluations: refused before any model is loaded.
    shutil.rmtree(tmp_path / "features")
    write_specforge_run(tmp_path, tiny_cache, tiny_drafter_config, eval_set=False, max_steps=2)
    done = specforge_train(tmp_path, tiny_cache)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: --keep-best-by-tau: ")
    assert "training.eval_interval=0" in done.stderr and "Loaded LM Head" not in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_a_domino_drafter_training_in_specforges_loop_is_scored_live(tmp_path, tiny_cache, tiny_drafter_config):
    """SpecForge's ``TrainerController`` training its ``DominoDraftModel`` with its own Domino strategy
    (``OnlineDominoModel``, ``DominoTrainStrategy``: the base loss blended in and decaying), the live evaluation
    attached (the drafter adopted from SpecForge's module, sharing its weights): the tau logged at step 0 and at
    fit end equals the tool's on that step's weights saved with SpecForge's ``save_pretrained``; training moved
    it; the family's own walk (the correction off) is logged too."""
    from specforge.algorithms.common.dflash_family_model import OnlineDominoModel
    from specforge.modeling.draft.domino import DominoDraftModel
    from specforge.training.strategies.base import DominoTrainStrategy

    from dflash_cb.core.drafters.domino.figures import FIGURES as DOMINO

    cfg = {**tiny_drafter_config, "architectures": ["DominoDraftModel"],
           "dflash_config": {**tiny_drafter_config["dflash_config"], "projector_type": "domino", "emb_dim": 16,
                             "gru_hidden_dim": 8}}
    log = Log(tmp_path)
    controller, log.drafter = specforge_controller(tiny_cache, cfg, tmp_path / "out", max_steps=4, logger=log,
                                                   draft_class=DominoDraftModel, online_class=OnlineDominoModel,
                                                   strategy_class=DominoTrainStrategy)
    attach(controller, tiny_cache, every_n_train_steps=4, console=False)
    assert controller.fit(train_batches(tiny_cache)) == 4
    logged = log.evaluations()
    assert sorted(logged) == [0, 4] and logged[4][TAU] != logged[0][TAU]
    for step in (0, 4):
        assert all(PREFIX + w.key in logged[step] for w in DOMINO.walks)
        assert tool_metrics(tiny_cache, tmp_path / f"drafter_{step}", tmp_path / f"r{step}.json", True,
                            cfg["block_size"], ())["tau"] == logged[step][TAU]


@pytest.mark.e2e
def test_a_dspark_drafter_training_in_specforges_loop_is_scored_live(tmp_path, oracle_world, tiny_cache):
    """SpecForge's ``TrainerController`` training its ``DSparkDraftModel`` (a gated Markov head and a confidence
    head) with its own DSpark strategy (``OnlineDSparkModel``: CE, L1 and confidence terms, which read the target's
    final-normed state: the cache's last layer, in the batches), the live evaluation attached: the tau logged at
    step 0 and at fit end equals the tool's on that step's weights; training moved it; the family's figures (the
    Markov head off, the confidence head's calibration) are logged beside it."""
    from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from specforge.training.strategies.base import DSparkTrainStrategy

    from dflash_cb.core.drafters.dspark.figures import FIGURES as DSPARK
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    cache = oracle_world["plain"]  # layers 1 and 3 of a 4-layer target: 3 is its final-normed state
    m = cache.manifest
    cfg = tiny_drafter_config(m.vocab_size, m.hidden_size, 4, [1], 127, block_size=6, family="dspark",
                              markov_head_type="gated")
    cfg["dflash_config"] = {**cfg["dflash_config"], "confidence_head_alpha": 0.5, "enable_confidence_head": True}
    log = Log(tmp_path)
    controller, log.drafter = specforge_controller(cache.path, cfg, tmp_path / "out", max_steps=4, logger=log,
                                                   draft_class=DSparkDraftModel, online_class=OnlineDSparkModel,
                                                   strategy_class=DSparkTrainStrategy)
    attach(controller, cache.path, every_n_train_steps=4, console=False)
    assert controller.fit(train_batches(cache, layer_ids=[1], strategy=DSparkTrainStrategy)) == 4
    logged = log.evaluations()
    assert sorted(logged) == [0, 4] and logged[4][TAU] != logged[0][TAU]
    for step in (0, 4):
        assert all(PREFIX + f.key in logged[step] for f in (*DSPARK.walks, *DSPARK.pooled))
        assert tool_metrics(cache.path, tmp_path / f"drafter_{step}", tmp_path / f"r{step}.json", True,
                            cfg["block_size"], ())["tau"] == logged[step][TAU]
    with pytest.raises(ValueError, match=r"reads the target's final-normed state, the cache's layer 3, which it does"):
        train_batches(tiny_cache, strategy=DSparkTrainStrategy)  # layers 0 and 2 of the same depth
