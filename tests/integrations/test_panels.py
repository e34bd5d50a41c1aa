"""The W&B panels (tools/wandb_panels.py) against a real offline run written by the callback.

Every key a panel references must exist in that run's history or summary, so renaming a metric
fails here instead of leaving an empty panel. The view is built and serialised offline; the one
network call (``save()``) is not tested.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything

from dflash_cb import DFlashEvalCallback
from dflash_cb.cache.states import StateCache
from dflash_cb.core.figures.positions import cycle_labels, position_labels
from dflash_cb.demo.lightning_module import CachedStatesDataModule
from dflash_cb.integrations.tracking.panels import (
    PanelLayout,
    build_report,
    build_workspace,
    layout_from_keys,
    panel_plan,
    referenced_keys,
)

BUDGETS = [4, 8]
EDGES = (0, 8, 16)


@pytest.fixture(scope="module")
def offline_run(tiny_cache, tiny_drafter_config, tmp_path_factory) -> dict:
    """A real training run with the callback, a measured baseline and a published figure, logged offline."""
    from lightning.pytorch.loggers import WandbLogger
    from lightning_runs import make_module, make_trainer
    from wandb_runs import history_and_summary, write_published

    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.results_file import report_to_results, write_results

    tmp = tmp_path_factory.mktemp("panels")
    torch.manual_seed(7)
    cache = StateCache(tiny_cache)
    write_results(report_to_results(evaluate(cache, DFlashDrafter.from_config_dict(tiny_drafter_config).eval(),
                                             budgets=BUDGETS), cache), tmp / "zlab.json")
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=BUDGETS,
                            baselines={"zlab": str(tmp / "zlab.json")}, published=write_published(tmp / "pub.yaml"),
                            table_samples=2, position_edges=EDGES, prog_bar=True)
    logger = WandbLogger(project="dflash-cb-test", name="panels", save_dir=str(tmp), offline=True)
    seed_everything(0, verbose=False)
    trainer = make_trainer(tmp, [cb], 4, logger=logger)
    trainer.fit(make_module(tiny_drafter_config, tiny_cache), CachedStatesDataModule(str(tiny_cache), batch_size=2))
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    history, summary, _ = history_and_summary(run_dir)
    return {"history": history, "summary": summary, "cb": cb, "trainer": trainer, "run_dir": run_dir}


def _layout(cb: DFlashEvalCallback, block_size: int) -> PanelLayout:
    """What a user passes to tools/wandb_panels.py for this run: from its configuration, not its keys."""
    return PanelLayout(budgets=BUDGETS, categories=sorted({s.category for s in cb.evaluator.session.cache.samples}),
                       block_size=block_size, position_buckets=position_labels(EDGES), cycle_buckets=cycle_labels(),
                       baselines=["baseline/zlab"], published=["published/paper-x/tau", "published/paper-y/tau_request_mean"])


@pytest.mark.e2e
def test_every_panel_key_exists_in_the_logged_run(offline_run, tiny_drafter_config):
    history, summary, cb = offline_run["history"], offline_run["summary"], offline_run["cb"]
    logged = set().union(*history) | set(summary)
    plan = panel_plan(_layout(cb, tiny_drafter_config["block_size"]))
    refs = referenced_keys(plan)
    assert refs["line"] and refs["scalar"] and refs["table"]
    # A metric without a value at any evaluation (NaN: e.g. a depth no anchor reached) is not logged,
    # but the callback computed it under that name.
    nan_everywhere = {"dflash_eval/" + k for k, v in cb.history[-1].items() if v != v}
    assert refs["line"] <= logged | nan_everywhere, sorted(refs["line"] - logged - nan_everywhere)
    assert len(refs["line"] & nan_everywhere) <= 4  # the check is not vacuous
    assert refs["scalar"] <= set(summary), sorted(refs["scalar"] - set(summary))
    for table in refs["table"]:  # a logged table appears as <key>/_type, <key>/path, ...
        assert any(k.startswith(table + "/") for k in logged), table
    assert [s for s, panels in plan.items() if panels] == ["Headline", "Uncertainty", "Per category", "Per depth",
                                                            "By position", "Cost", "Samples"]
    # The same layout is recovered from the logged keys alone (tools/wandb_panels.py --run).
    back = layout_from_keys(logged)
    want = _layout(cb, tiny_drafter_config["block_size"])
    assert back.block_size == want.block_size
    for f in ("budgets", "categories", "position_buckets", "cycle_buckets", "baselines", "published"):
        assert list(getattr(back, f)) == list(getattr(want, f)), f


@pytest.mark.e2e
def test_view_and_report_build_and_the_view_serialises(offline_run, tiny_drafter_config):
    layout = _layout(offline_run["cb"], tiny_drafter_config["block_size"])
    view = build_workspace("my-team", "dflash-cb-test", layout)
    wire = json.loads(view._to_model().model_dump_json())  # what save() would send
    text = json.dumps(wire)
    for key in ("dflash_eval/tau_ci_low", "dflash_eval/baseline/zlab/delta_tau", "dflash_eval/position/8_16/tau",
                "dflash_eval/cycle/4plus/tau", "dflash_eval/sample_table", "trainer/global_step"):
        assert key in text, key
    assert [s.name for s in view.sections][:2] == ["Headline", "Uncertainty"]
    report = build_report("my-team", "dflash-cb-test", layout)  # serialising a report needs a W&B login
    assert sum(len(b.panels) for b in report.blocks if hasattr(b, "panels")) == sum(
        len(p) for p in panel_plan(layout).values())


@pytest.mark.e2e
def test_the_run_holds_intervals_deltas_best_tau_and_positions(offline_run):
    history, summary = offline_run["history"], offline_run["summary"]
    evals = [h for h in history if "dflash_eval/tau" in h]
    assert [h["trainer/global_step"] for h in evals] == [0, 2, 4]
    for h in evals:
        assert h["dflash_eval/tau_ci_low"] <= h["dflash_eval/tau"] <= h["dflash_eval/tau_ci_high"]
        d = h["dflash_eval/baseline/zlab/delta_tau"]
        assert d == pytest.approx(h["dflash_eval/tau"] - h["dflash_eval/baseline/zlab/tau"])
        assert h["dflash_eval/baseline/zlab/delta_tau_ci_low"] <= d <= h["dflash_eval/baseline/zlab/delta_tau_ci_high"]
        cycles = sum(h[f"dflash_eval/position/{b}/cycles"] for b in position_labels(EDGES))
        assert cycles == h["dflash_eval/cycles"] == sum(h[f"dflash_eval/cycle/{b}/cycles"] for b in cycle_labels())
    best = max(evals, key=lambda h: h["dflash_eval/tau"])
    assert summary["dflash_eval/best/tau"] == best["dflash_eval/tau"]
    assert summary["dflash_eval/best/step"] == best["trainer/global_step"]
    assert summary["dflash_eval/tau"]["max"] == best["dflash_eval/tau"]  # define_metric(summary="max,last")
    assert summary["dflash_eval/tau"]["last"] == evals[-1]["dflash_eval/tau"]
    assert offline_run["trainer"].progress_bar_metrics["dflash_eval/tau"] == pytest.approx(evals[-1]["dflash_eval/tau"])


@pytest.mark.e2e
def test_console_line_per_evaluation(offline_run):
    from dflash_cb.core.results.report import evaluation_line

    cb = offline_run["cb"]
    h = cb.history[-1]
    line = evaluation_line(int(h["step"]), h, BUDGETS, ["baseline/zlab"])
    assert line.startswith(f"step 4: tau {h['tau']:.3f} [{h['tau_ci_low']:.2f}, {h['tau_ci_high']:.2f}]")
    assert f"DDTree b8 {h['ddtree/tau_b8']:.3f}" in line and "vs zlab " in line
    assert line.endswith(f" s ({h['eval_overhead']:.1%} of wall time)")


def test_panels_tool_dry_run_builds_the_view_without_network(capsys):
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.tracking.panels import main

    assert run(main, ["--entity", "e", "--project", "p", "--budgets", "4,8", "--categories", "chat,code",
                      "--baselines", "z-lab drafter", "--block-size", "6", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    keys = {k for panels in plan.values() for p in panels for k in p["keys"]}
    assert "dflash_eval/baseline/z-lab_drafter/delta_tau_ci_high" in keys and "dflash_eval/acceptance/depth_05" in keys
    assert run(main, ["--entity", "e", "--project", "p", "--position-edges", "3,1", "--dry-run"]) == 2
    assert "--position-edges '3,1': expected comma-separated integers from 0, strictly increasing" in capsys.readouterr().err
    # The callback's rule (dflash_cb.common.arguments), naming the option, not "invalid literal for int()".
    assert run(main, ["--entity", "e", "--project", "p", "--budgets", "16,3x", "--dry-run"]) == 2
    assert "--budgets '16,3x': expected comma-separated positive integers" in capsys.readouterr().err
    # A published figure is drawn only beside the live figure of its convention.
    assert run(main, ["--entity", "e", "--project", "p", "--published", "paper-a,paper-b:request_mean",
                      "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    lines = [p["keys"] for p in plan["Headline"]]
    assert ["dflash_eval/tau_request_mean", "dflash_eval/published/paper-b/tau_request_mean"] in lines
    assert any("dflash_eval/published/paper-a/tau" in k and "dflash_eval/tau" in k for k in lines)
    assert not any("dflash_eval/published/paper-b/tau" in k for k in lines)
    assert run(main, ["--entity", "e", "--project", "p", "--published", "paper-c:median", "--dry-run"]) == 2
    assert "unknown convention 'median'" in capsys.readouterr().err


def _ddtree_panel(plan: dict) -> tuple[str, ...]:
    (spec,) = [p for p in plan["Headline"] if p.title.startswith("DDTree tau per budget")]
    return spec.keys


@pytest.mark.e2e
def test_panels_show_what_the_light_and_full_profiles_log(offline_run, tiny_drafter_config):
    """Light evaluations log only the largest budget; the others are full/ keys."""
    history, cb = offline_run["history"], offline_run["cb"]
    evals = [h for h in history if "dflash_eval/tau" in h]
    full = [h for h in evals if "dflash_eval/full/tau" in h]
    assert cb.config.light_budgets == (8,) and full and len(full) < len(evals)  # both profiles ran
    layout = _layout(cb, tiny_drafter_config["block_size"])  # what a user passes: the callback's configuration
    keys = _ddtree_panel(panel_plan(layout))
    assert "dflash_eval/ddtree/tau_b8" in keys and "dflash_eval/full/ddtree/tau_b4" in keys
    assert "dflash_eval/ddtree/tau_b4" not in keys  # a point at the full evaluations only, unmarked
    for k in keys:  # every series has a point at every evaluation of its profile
        for h in (full if "/full/" in k else evals):
            assert k in h, (k, h["trainer/global_step"])
    # References: no DDTree key the layout cannot know was logged; from the run's keys, exactly those logged.
    assert not [k for k in keys if "/baseline/" in k or "/published/" in k]
    logged = set().union(*history)
    rows_layout = layout_from_keys(logged | set(offline_run["summary"]), light_budgets=[8])
    keys = _ddtree_panel(panel_plan(rows_layout))
    assert {"dflash_eval/baseline/zlab/ddtree/tau_b4", "dflash_eval/published/paper-x/ddtree/tau_b8"} <= set(keys)
    assert set(keys) <= logged
    # The served baseline: its tau, never a paired delta (it has no per-sample lengths).
    served = layout_from_keys(logged | {"dflash_eval/baseline/served/tau"})
    refs = referenced_keys(panel_plan(served))["line"]
    assert served.served and "baseline/served" not in served.baselines
    assert "dflash_eval/baseline/served/tau" in refs and not [k for k in refs if "served/delta" in k]
    assert not [k for k in referenced_keys(panel_plan(layout))["line"] if "/served/" in k]


@pytest.mark.e2e
def test_panels_tool_warns_about_panels_the_run_never_logged(offline_run, capsys):
    """--run (here a local offline run folder: no network) checks the layout against its keys."""
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.tracking.panels import main

    args = ["--entity", "e", "--project", "p", "--run", str(offline_run["run_dir"]), "--dry-run"]
    assert run(main, args) == 0
    out = capsys.readouterr()
    assert out.err == "", out.err
    plan = json.loads(out.out)
    logged = set().union(*offline_run["history"]) | set(offline_run["summary"])
    shown = {k for panels in plan.values() for p in panels if p["kind"] == "line" for k in p["keys"]}
    assert "dflash_eval/full/ddtree/tau_b4" in shown and "dflash_eval/ddtree/tau_b4" not in shown
    nan_everywhere = {"dflash_eval/" + k for k, v in offline_run["cb"].history[-1].items() if v != v}
    assert shown <= logged | nan_everywhere, sorted(shown - logged - nan_everywhere)
    assert run(main, [*args, "--prefix", "eval/"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "logged none of the panels' keys under --prefix 'eval/'" in err
    assert run(main, ["--entity", "e", "--project", "p", "--block-size", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --block-size 1:") and err.count("\n") == 1
    assert run(main, ["--entity", "e", "--project", "p", "--run", str(offline_run["run_dir"] / "files"),
                      "--dry-run"]) == 2
    assert "no run-*.wandb file" in capsys.readouterr().err


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_panels_tool_without_login_network_or_a_valid_url_is_one_line(tmp_path, monkeypatch, capsys):
    """No W&B login, no network, a malformed --url: one line, exit 2 (only 127.0.0.1 is dialled)."""
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.tracking.panels import main

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no login
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    base = ["--entity", "e", "--project", "p", "--budgets", "4,8"]

    def one_line(*extra: str) -> str:
        assert run(main, [*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    for extra in ((), ("--run", "abc123"), ("--url", "https://wandb.ai/e/p?nw=abc")):
        err = one_line(*extra)
        assert "wandb login" in err and "--dry-run" in err, (extra, err)
    for url in ("not-a-url", "https://wandb.ai/e", "https://wandb.ai/e/p?nw=nwuserme", "https://wandb.ai/e/p"):
        assert f"--url {url!r}: not a saved workspace view" in one_line("--url", url)
    assert "drop one of the two" in one_line("--url", "https://wandb.ai/e/p?nw=abc", "--report")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a key, but nothing answers at WANDB_BASE_URL
    err = one_line()
    assert "saving the view failed" in err and "WANDB_BASE_URL" in err


# -- --show on a local run folder that is missing, damaged or ambiguous ------------------------------------------

@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A real offline W&B run (``wandb.init(mode="offline")``) that logged three evaluations' tau."""
    import wandb
    from wandb_runs import finished_records

    tmp = tmp_path_factory.mktemp("small_run")
    run = wandb.init(project="dflash-cb-test", dir=str(tmp), mode="offline")
    for step in range(3):
        run.log({"dflash_eval/tau": 1.0 + step, "trainer/global_step": step})
    run_dir = Path(run.dir).parent
    run.finish()
    finished_records(run_dir)
    return run_dir


def _show(capsys, run_dir) -> tuple[int, str, str]:
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.tracking.panels import main

    code = run(main, ["--run", str(run_dir), "--show"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _copy_run(run_dir: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run_dir, to)
    return next(to.glob("run-*.wandb"))


def test_show_prints_a_local_run(small_run, capsys):
    code, out, err = _show(capsys, small_run)
    assert code == 0 and err == "" and "3.0000" in out, (out, err)


def test_show_on_a_damaged_run_log_is_one_line_naming_the_file(small_run, tmp_path, capsys):
    """A flipped bit anywhere in a record (each record carries a CRC-32 of its kind and bytes), a record
    whose bytes are no W&B record, and garbage behind the header: one line naming the file and the offset."""
    import struct
    import zlib

    log = _copy_run(small_run, tmp_path / "flipped")
    data = bytearray(log.read_bytes())
    for at in (7 + 7 + 3, len(data) // 2):  # inside the first record's bytes, and half-way in
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        log.write_bytes(bytes(flipped))
        code, out, err = _show(capsys, log.parent)
        assert code == 2 and err.count("\n") == 1 and str(log) in err and "damaged" in err, (at, err)
        assert "Traceback" not in err and out == ""
    payload = b"\xff\xff\xff\xff"  # a valid frame around bytes that are no protobuf Record
    crc = zlib.crc32(payload, zlib.crc32(bytes([1])))
    log.write_bytes(bytes(data[:7]) + struct.pack("<IHB", crc, len(payload), 1) + payload)
    code, out, err = _show(capsys, log.parent)
    assert code == 2 and err.count("\n") == 1 and str(log) in err and "not a W&B record" in err, err
    log.write_bytes(bytes(data[:7]) + bytes(range(256)) * 4)
    code, out, err = _show(capsys, log.parent)
    assert code == 2 and err.count("\n") == 1 and str(log) in err and "damaged" in err, err


def test_show_on_a_folder_that_does_not_exist_names_it(tmp_path, capsys, monkeypatch):
    """A path that is not there is not a W&B run id: no word of API keys."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    missing = tmp_path / "wandb" / "offline-run-20260101_000000-abc"
    code, out, err = _show(capsys, missing)
    assert code == 2 and err.count("\n") == 1 and f"--run {missing}: no such folder" in err, err
    assert "API key" not in err and "login" not in err


def test_a_run_folder_with_two_logs_names_both(small_run, tmp_path, capsys):
    """Two run-*.wandb files in one folder: which one is meant is the user's to say (the file itself)."""
    import shutil

    log = _copy_run(small_run, tmp_path / "two")
    other = log.with_name("run-zzzzzzzz.wandb")
    shutil.copy(log, other)
    code, out, err = _show(capsys, log.parent)
    assert code == 2 and err.count("\n") == 1 and log.name in err and other.name in err, err
    assert f"--run {log}" in err  # the fix: give the file
    code, out, err = _show(capsys, other)
    assert code == 0 and "3.0000" in out


def test_the_by_position_section_shows_what_each_bucket_rests_on():
    """A bucket's tau beside its cycle count: a bucket of a few cycles says little, and the panel shows it."""
    from dflash_cb.core.figures.metrics import position_cycles, position_tau

    buckets = position_labels(EDGES)
    plan = panel_plan(PanelLayout(budgets=BUDGETS, position_buckets=buckets))
    keys = [p.keys for p in plan["By position"]]
    assert tuple("dflash_eval/" + position_tau(b) for b in buckets) in keys
    assert tuple("dflash_eval/" + position_cycles(b) for b in buckets) in keys


def test_the_selector_section_is_built_from_the_metric_names():
    """A DFlash 2 run gets the Drafter family panels (its keys from its family's figures); a DFlash run none, and the
    layout read back from a run's keys says which it was."""
    from dflash_cb.core.drafters.dflash2.figures import (
        SELECTOR_ORACLE_TAU,
        SELECTOR_UNARY_TAU,
        selector_acc,
        selector_recall,
    )

    assert panel_plan(PanelLayout(block_size=8))["Drafter family"] == []
    section = panel_plan(PanelLayout(block_size=8, family="dflash2"))["Drafter family"]
    keys = {k for spec in section for k in spec.keys}
    assert {"dflash_eval/" + k for k in (SELECTOR_UNARY_TAU, SELECTOR_ORACLE_TAU, selector_recall(7), selector_acc(1))} \
        <= keys and not any(k.endswith("_08") for k in keys)
    logged = ["dflash_eval/tau", "dflash_eval/acceptance/depth_07", "dflash_eval/" + SELECTOR_UNARY_TAU]
    assert layout_from_keys(logged).family == "dflash2" and layout_from_keys(logged[:2]).family is None


@pytest.mark.e2e
def test_a_local_run_is_inspected_whole_and_its_panels_cover_what_the_readme_argues(offline_run, capsys):
    """``--run DIR --show`` lists every key the run logged (not only the series table's columns); ``--dry-run``
    needs no --entity/--project; the plan has panels for the training's accuracy against tau, the all-anchor
    figures, the evaluation's overhead and the committed-tokens histogram."""
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.tracking.panels import main

    assert run(main, ["--run", str(offline_run["run_dir"]), "--show"]) == 0
    shown = capsys.readouterr().out
    logged = set().union(*offline_run["history"])
    listed = shown.split("every key logged (", 1)[1].splitlines()[1:]
    assert {line.split()[0] for line in listed} == logged and len(logged) > 100
    assert run(main, ["--run", str(offline_run["run_dir"]), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    keys = {k for panels in plan.values() for p in panels for k in p["keys"]}
    wanted = {"dflash_eval/specforge/acc", "dflash_eval/all_anchor_tau", "dflash_eval/eval_overhead",
              "dflash_eval/produced_frac/01", "dflash_eval/chain_tau_estimate"}
    assert wanted <= keys
    assert wanted - {"dflash_eval/chain_tau_estimate"} <= logged  # a block drafter's run: no chain estimate
    assert run(main, ["--budgets", "4", "--dry-run"]) == 0 and capsys.readouterr().out.startswith("{")


# -- what --show and --dry-run import: the counted work, not a clock ---------------------------------------------

# Modules --show and --dry-run never need: W&B's SDK (its import alone is a second or more), Lightning, the
# workspace library (only building a view needs it) and transformers (the drafter modules' layers).
HEAVY = ("wandb", "lightning", "wandb_workspaces", "transformers")


def _imported_by(argv: list[str]) -> tuple[int, list[str], str]:
    """(exit code, the HEAVY modules imported, stderr) of the panels tool run with ``argv`` in a fresh interpreter."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, contextlib, io\n"
            "from dflash_cb.common.cli import run\n"
            "from dflash_cb.integrations.tracking.panels import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = run(main, {argv!r})\n"
            f"print(rc, *sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr
    rc, *heavy = done.stdout.split()
    return int(rc), heavy, done.stderr


@pytest.mark.e2e
def test_show_and_dry_run_import_neither_wandb_lightning_nor_transformers(offline_run):
    """``--show`` and ``--dry-run`` (on a run folder or from options) read the run's log without W&B's SDK and the
    families' figures without their drafter modules: each call was 22-25 s on a loaded 2-core machine, most of it
    importing what they do not use."""
    run_dir = str(offline_run["run_dir"])
    for argv in (["--run", run_dir, "--show"], ["--run", run_dir, "--dry-run"], ["--budgets", "4,8", "--dry-run"]):
        rc, heavy, err = _imported_by(argv)
        assert rc == 0 and heavy == [], (argv, heavy, err)


def test_the_families_figures_read_without_the_registry_are_the_registrys():
    """``family_figures`` (each family folder's figures module, no drafter modules) is what the registry's families
    carry: a family's figures moved elsewhere fail here instead of leaving its panels out."""
    from dflash_cb.core.drafters.base import FamilyFigures
    from dflash_cb.core.drafters.registry import families
    from dflash_cb.core.results.compare import family_walks as registry_walks
    from dflash_cb.integrations.tracking.panels import family_figures, family_walks

    found = family_figures()
    assert {f.name for f in families() if f.figures != FamilyFigures()} == set(found) != set()
    assert all(found[f.name] is f.figures for f in families() if f.name in found)
    assert family_walks() == registry_walks()


def test_the_offline_readers_field_numbers_are_wandbs():
    """The offline reader decodes the history, summary and config by their protobuf field numbers: they are those
    of the installed wandb's own messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    from dflash_cb.integrations.tracking import wandb_offline as w

    def number(message, name: str) -> int:
        return message.DESCRIPTOR.fields_by_name[name].number

    assert (w.RECORD_HISTORY, w.RECORD_SUMMARY, w.RECORD_CONFIG, w.RECORD_RUN) == tuple(
        number(pb.Record, n) for n in ("history", "summary", "config", "run"))
    assert w.ITEMS == number(pb.HistoryRecord, "item") == number(pb.SummaryRecord, "update") \
        == number(pb.ConfigRecord, "update")
    assert w.RUN_CONFIG == number(pb.RunRecord, "config")
    for item in (pb.HistoryItem, pb.SummaryItem, pb.ConfigItem):
        assert (w.ITEM_KEY, w.ITEM_NESTED_KEY, w.ITEM_VALUE_JSON) == tuple(
            number(item, n) for n in ("key", "nested_key", "value_json"))


@pytest.mark.e2e
def test_the_offline_readers_equal_wandbs_own_messages(offline_run):
    """History, summary and config read from the wire format equal what wandb's own ``Record`` messages hold."""
    from dflash_cb.integrations.tracking.wandb_offline import offline_config, offline_history, offline_records

    rows, summary, config = [], {}, {}
    for r in offline_records(offline_run["run_dir"]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.summary.update})
        for i in r.run.config.update if kind == "run" else r.config.update if kind == "config" else []:
            if (i.key or "/".join(i.nested_key)) != "_wandb":
                config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    assert offline_history(offline_run["run_dir"]) == (rows, summary) and len(rows) > 2 and summary
    assert offline_config(offline_run["run_dir"]) == config and config
