"""The sixth probe's findings (issue 53): cost profiles, the projection, chain lengths, MTP and EAGLE-3 folders.
Each case ends as a clear error before any work (naming the input and the fix), a warning where the input is
legal but suspicious, or a correct answer; nothing written is lost."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from dflash_cb.common.cli import run
from dflash_cb.core.costs.serving import CostProfile, ProfileError


def _error(code: int, capsys, *words: str) -> str:
    """A one-line user error (exit code 2) holding every word."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(w in err for w in words), err
    return err


def _csv(tmp_path: Path, text: str | bytes, name: str = "v.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _profile(tmp_path: Path, rows: str = "1,0.02\n9,0.022\n", name: str = "p.json", *extra: str) -> Path:
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    out = tmp_path / name
    csv_path = _csv(tmp_path, "verified_tokens,seconds\n" + rows, name + ".csv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert profile_cli.main(["--from-csv", str(csv_path), "--draft-seconds", "0.004", *extra,
                                 "--out", str(out)]) == 0
    return out


# -- data loss ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["same", "symlink", "chain_k1"])
def test_eval_drafter_never_writes_over_its_profile(tiny_cache, drafter_dir, tmp_path, capsys, how) -> None:
    """--out the profile itself, a link to it, or one K's .kK file that is the profile: refused, the profile kept."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    prof = _profile(tmp_path, name="r.k1.json" if how == "chain_k1" else "p.json")
    before = prof.read_bytes()
    out = prof
    extra: list[str] = []
    if how == "symlink":
        out = tmp_path / "link.json"
        out.symlink_to(prof)
    elif how == "chain_k1":
        out = tmp_path / "r.json"
        extra = ["--speculative-tokens", "1,3"]
    code = run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(out),
                               "--profile", str(prof), *extra])
    _error(code, capsys, "--profile", "somewhere else")
    assert prof.read_bytes() == before


def test_profile_costs_never_writes_into_the_model_folders(tiny_cache, drafter_dir, tmp_path, capsys) -> None:
    """A new file inside the target's (or a drafter's) folder would be read by the next loader: refused."""
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    target = tmp_path / "target"
    shutil.copytree(tiny_cache.parent / "target", target)
    before = sorted(p.name for p in target.iterdir())
    for out in (target / "model.safetensors.index.json", target / "sub" / "p.json"):
        code = run(profile_cli.main, ["--roofline", "--bandwidth-gbs", "100", "--peak-tflops", "1", "--target",
                                      str(target), "--drafter", str(drafter_dir), "--out", str(out)])
        _error(code, capsys, "--target", "model folder", "outside it")
    code = run(profile_cli.main, ["--roofline", "--bandwidth-gbs", "100", "--peak-tflops", "1", "--target",
                                  str(target), "--drafter", str(drafter_dir), "--out", str(drafter_dir / "p.json")])
    _error(code, capsys, "--drafter", "model folder")
    assert sorted(p.name for p in target.iterdir()) == before and not (drafter_dir / "p.json").exists()


@pytest.mark.parametrize("tool", ["serve_plan", "compare"])
def test_a_report_never_replaces_a_users_markdown(tmp_path, capsys, tool) -> None:
    """--out report.final writes report.final.md (not report.md); a report.md that is not this tool's own earlier
    output is never replaced; '.' and '' are refused in one line."""
    from dflash_cb.core.results.results_file import ResultsError, report_paths
    from dflash_cb.integrations.cli import compare as compare_cli
    from dflash_cb.integrations.cli import serve_plan as serve_plan_cli

    main = serve_plan_cli.main if tool == "serve_plan" else compare_cli.main
    notes = tmp_path / "report.md"
    notes.write_text("# my notes\n")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json").write_text("{}")
    for out in ("report", "report.md", ".", "", str(tmp_path) + "/"):
        code = run(main, [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out",
                          str(tmp_path / out) if out in ("report", "report.md") else out])
        _error(code, capsys, "--out")
    assert notes.read_text() == "# my notes\n"
    md, png = report_paths(str(tmp_path / "report.final"), "# x", "plan")
    assert md == tmp_path / "report.final.md" and png == tmp_path / "report.final.png"
    (tmp_path / "own.md").write_text("# x\nearlier\n")
    assert report_paths(str(tmp_path / "own"), "# x", "plan")[0] == tmp_path / "own.md"  # its own: replaced
    with pytest.raises(ResultsError, match="not an earlier report"):
        report_paths(str(tmp_path / "report"), "# x", "plan")


# -- profile_costs: a CSV checked as a whole, the arguments before any work ------------------------------------

BAD_CSVS = {  # rows after the header -> words of the one-line error
    "negative": ("1,0.02\n4,-0.03\n", ["line 3", "positive number of seconds"]),
    "zero": ("1,0\n4,0.03\n", ["line 2", "positive number of seconds"]),
    "nan": ("1,nan\n4,0.03\n", ["line 2", "positive"]),
    "inf": ("1,0.02\n4,inf\n", ["line 3", "positive"]),
    "huge": ("1,0.02\n4,1e300\n", ["line 3", "up to 3600"]),
    "zero_tokens": ("0,0.02\n1,0.02\n4,0.03\n", ["line 2", "1 token or more"]),
    "negative_tokens": ("1,0.02\n-4,0.03\n", ["line 3", "1 token or more"]),
    "text": ("1,fast\n4,0.03\n", ["line 2", "'fast' is not a number"]),
    "non_monotone": ("1,0.02\n9,0.0002\n", ["not monotone", "10%", "9 tokens"]),
    "one_row": ("1,0.02\n", ["only the 1-token row", "add rows"]),
    "no_one": ("2,0.02\n9,0.03\n", ["verified_tokens 1"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CSVS))
def test_a_bad_csv_is_one_line_naming_the_row(tmp_path, capsys, case) -> None:
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    rows, words = BAD_CSVS[case]
    path = _csv(tmp_path, "verified_tokens,seconds\n" + rows)
    code = run(profile_cli.main, ["--from-csv", str(path), "--draft-seconds", "0.004", "--out", str(tmp_path / "p")])
    _error(code, capsys, f"--from-csv {path}", *words)
    assert not (tmp_path / "p").exists()


def test_csv_encodings_bom_accepted_latin1_named(tmp_path, capsys) -> None:
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    bom = _csv(tmp_path, b"\xef\xbb\xbfverified_tokens,seconds\r\n1,0.02\r\n9,0.03\r\n", "excel.csv")
    assert run(profile_cli.main, ["--from-csv", str(bom), "--draft-seconds", "0", "--out", str(tmp_path / "a")]) == 0
    assert CostProfile.from_dict(json.loads((tmp_path / "a").read_text())).verify[0] == ((1, 0.02), (9, 0.03))
    latin = _csv(tmp_path, "verified_tokens,seconds\n1,0.02\n9,0.03 # caf\xe9\n".encode("latin-1"), "l.csv")
    code = run(profile_cli.main, ["--from-csv", str(latin), "--draft-seconds", "0", "--out", str(tmp_path / "b")])
    _error(code, capsys, "line 3", "0xe9", "UTF-8")


def test_a_csv_in_milliseconds_is_warned_about_and_no_target_identity_too(tmp_path) -> None:
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    path = _csv(tmp_path, "verified_tokens,seconds\n1,20\n9,22\n")
    with pytest.warns(UserWarning) as caught:
        assert profile_cli.main(["--from-csv", str(path), "--draft-seconds", "0", "--out", str(tmp_path / "p")]) == 0
    said = " ".join(str(w.message) for w in caught)
    assert "milliseconds" in said and "no --target or --states" in said


@pytest.mark.parametrize("seconds,words", [
    ("inf", ["--draft-seconds inf", "between 0 and"]),
    ("0.004,-1", ["value 2", "between 0 and"]),
    ("0.004,nan", ["value 2", "between 0 and"]),
])
def test_draft_seconds_are_finite_for_every_drafter(tmp_path, drafter_dir, capsys, seconds, words) -> None:
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    path = _csv(tmp_path, "verified_tokens,seconds\n1,0.02\n9,0.03\n")
    drafters = f"{drafter_dir},{drafter_dir}" if "," in seconds else str(drafter_dir)
    code = run(profile_cli.main, ["--from-csv", str(path), "--draft-seconds", seconds, "--drafter", drafters,
                                  "--out", str(tmp_path / "p")])
    _error(code, capsys, *words)


@pytest.mark.parametrize("extra,words", [
    (["--tokens", "2-9"], ["--tokens 2-9", "needs 1"]),
    (["--device", "banana"], ["--device 'banana'"]),
    (["--batch-size", "8"], ["--batch-size 8", "batch 1"]),
    (["--no-drafter"], ["--drafter DRAFTER_DIR is needed", "0 s"]),
    (["--roofline", "--bandwidth-gbs", "inf", "--peak-tflops", "1"], ["--bandwidth-gbs inf", "range"]),
    (["--roofline", "--bandwidth-gbs", "1e-300", "--peak-tflops", "1"], ["--bandwidth-gbs 1e-300", "range"]),
    (["--roofline", "--bandwidth-gbs", "100", "--peak-tflops", "inf"], ["--peak-tflops inf", "range"]),
])
def test_measuring_arguments_are_checked_before_any_model_is_read(tiny_cache, drafter_dir, tmp_path, capsys,
                                                                  monkeypatch, extra, words) -> None:
    from dflash_cb.cache import target as target_mod
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(target_mod, "load_target", no_loading)
    drafter = [] if "--no-drafter" in extra else ["--drafter", str(drafter_dir)]
    extra = [e for e in extra if e != "--no-drafter"]
    code = run(profile_cli.main, ["--target", str(tiny_cache.parent / "target"), *drafter, *extra,
                                  "--out", str(tmp_path / "p.json")])
    _error(code, capsys, *words)
    assert not (tmp_path / "p.json").exists()


def test_device_cuda_without_a_gpu_is_refused_before_work(tiny_cache, drafter_dir, tmp_path, capsys,
                                                          monkeypatch) -> None:
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = run(profile_cli.main, ["--target", str(tiny_cache.parent / "target"), "--drafter", str(drafter_dir),
                                  "--device", "cuda", "--out", str(tmp_path / "p.json")])
    _error(code, capsys, "--device cuda", "no CUDA device")


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["verify"]["0"][0].__setitem__(1, True), ["a time of True"]),
    (lambda d: d.__setitem__("batch_size", 0), ["batch_size 0"]),
    (lambda d: d["target"].__setitem__("hidden_size", "64"), ["target hidden_size '64'", "integer"]),
    (lambda d: d["verify"]["0"][1].__setitem__(1, 1e300), ["up to 3600"]),
])
def test_a_damaged_profile_file_is_refused(tmp_path, tiny_cache, edit, words) -> None:
    data = json.loads(_profile(tmp_path, "1,0.02\n9,0.03\n", "p.json", "--states", str(tiny_cache)).read_text())
    edit(data)
    with pytest.raises(ProfileError) as e:
        CostProfile.from_dict(data, "--profile p.json")
    assert all(w in str(e.value) for w in ["--profile p.json", *words]), str(e.value)


# -- extract_drafter --mtp-from ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 target whose checkpoint ships a (random) one-layer MTP head under mtp.*."""
    from safetensors.torch import load_file, save_file
    from tiny_target import save_tiny_qwen3_5

    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.drafters.mtp.model import mtp_config_from_target

    target = save_tiny_qwen3_5(tmp_path_factory.mktemp("mtp6") / "target", seed=3, mtp_num_hidden_layers=1)
    torch.manual_seed(0)
    head = drafter_from_config(mtp_config_from_target(json.loads((target / "config.json").read_text()), 3))
    shard = target / "model.safetensors"
    save_file({**load_file(str(shard)), **{k: v.detach().clone() for k, v in head.state_dict().items()}}, str(shard),
              metadata={"format": "pt"})
    return target


def _damaged(mtp_target: Path, tmp_path: Path, how: str) -> Path:
    from safetensors import safe_open

    target = tmp_path / "target"
    shutil.copytree(mtp_target, target)
    if how == "layers":
        cfg = json.loads((target / "config.json").read_text())
        (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = 2
        (target / "config.json").write_text(json.dumps(cfg))
    elif how == "not_json":
        (target / "config.json").write_text("{ not json")
    elif how == "truncated":
        shard = target / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "index_lies":
        with safe_open(str(target / "model.safetensors"), framework="pt") as f:
            names = {k: "model.safetensors" for k in f.keys()}
        (target / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {**names, "mtp.fc.extra": "model.safetensors"}}))
    return target


@pytest.mark.parametrize("how,extra,words", [
    ("layers", [], ["mtp_num_hidden_layers 2", "one-layer"]),
    ("not_json", [], ["config.json", "not a readable config.json"]),
    ("truncated", [], ["model.safetensors", "copy"]),
    ("index_lies", [], ["mtp.fc.extra", "lacks"]),
    ("", ["--speculative-tokens", "0"], ["--speculative-tokens 0", "1 to 15"]),
    ("", ["--speculative-tokens", "-1"], ["--speculative-tokens -1", "1 to 15"]),
    ("", ["--speculative-tokens", "100"], ["--speculative-tokens 100", "1 to 15"]),
    ("", ["--config", "c.json"], ["drop --config and --prefix"]),
    ("", ["--prefix", "mtp."], ["drop --config and --prefix"]),
])
def test_mtp_from_refuses_in_one_line(mtp_target, tmp_path, capsys, how, extra, words) -> None:
    from dflash_cb.integrations.cli import extract as extract_cli

    target = _damaged(mtp_target, tmp_path, how) if how else mtp_target
    code = run(extract_cli.main, ["--mtp-from", str(target), "--out", str(tmp_path / "mtp"), *extra])
    _error(code, capsys, *words)
    assert not (tmp_path / "mtp").exists()


def test_speculative_tokens_with_ckpt_is_refused_not_ignored(tmp_path, capsys) -> None:
    from dflash_cb.integrations.cli import extract as extract_cli

    code = run(extract_cli.main, ["--ckpt", str(tmp_path / "x.ckpt"), "--speculative-tokens", "5", "--out",
                                  str(tmp_path / "out")])
    _error(code, capsys, "--speculative-tokens is for --from-target / --mtp-from")


def test_an_mtp_config_edited_to_read_a_middle_layer_is_refused(mtp_target, tmp_path) -> None:
    from dflash_cb.core.checkpoints.load import load_drafter
    from dflash_cb.integrations.cli import extract as extract_cli

    out = tmp_path / "mtp"
    assert extract_cli.main(["--mtp-from", str(mtp_target), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert load_drafter(out).spec.target_layer_ids == (cfg["num_target_layers"] - 1,)
    cfg["target_layer_ids"] = [1]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"target_layer_ids is \[1\]: an MTP head reads the target's last layer"):
        load_drafter(out)


# -- EAGLE-3 folders ----------------------------------------------------------------------------------------------

def _eagle3_folder(tmp_path: Path, edit=None, **extra) -> Path:
    from eagle3_reference import eagle_config

    from dflash_cb.core.drafters.layouts import drafter_from_config

    torch.manual_seed(0)
    drafter = drafter_from_config(eagle_config(**extra))
    with torch.no_grad():
        drafter.d2t.copy_(torch.arange(drafter.d2t.numel()) % 3)  # a real mapping, not the identity
        if edit is not None:
            edit(drafter.d2t)
    out = tmp_path / "eagle3"
    drafter.save_pretrained(out)
    return out


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.__setitem__(63, 1000), ["draft id 63", "outside the target's vocabulary"]),
    (lambda d: d.__setitem__(5, -100), ["draft id 5", "outside"]),
    (lambda d: d.__setitem__(1, d[0] - 1), ["draft ids 0 and 1 onto one target id"]),
])
def test_an_eagle3_d2t_that_is_no_mapping_is_refused_at_load(tmp_path, edit, words) -> None:
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    folder = _eagle3_folder(tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        load_drafter(folder)
    assert all(w in str(e.value) for w in [str(folder), *words]), str(e.value)


def test_eagle3_configs_that_contradict_themselves_are_refused() -> None:
    from eagle3_reference import eagle_config

    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.drafters.registry import spec_from_config

    with pytest.raises(ValueError, match="draft_vocab_size is 500, the target's vocab_size 128"):
        drafter_from_config(eagle_config(draft_vocab_size=500))
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 2, 3\] and eagle_config.* \[1, 3, 4\] disagree"):
        spec_from_config(eagle_config(target_layer_ids=[1, 2, 3]))
    base = {k: v for k, v in eagle_config().items() if k != "eagle_config"}
    with pytest.raises(ValueError, match=r"num_target_layers 3: too few.*gives \[1, 0, -1\]"):
        spec_from_config({**base, "num_target_layers": 3})
    assert spec_from_config(eagle_config(target_layer_ids=[1, 3, 4])).target_layer_ids == (1, 3, 4)


# -- serve_plan: profiles compared by identity, damaged files, labels, like for like --------------------------------

@pytest.fixture(scope="module")
def planned(tiny_cache, drafter_dir, tmp_path_factory) -> dict:
    """Results files of one drafter projected with: a CSV profile; the same CSV (one name) with other draft seconds;
    the first profile again but with --tail-blocks reference."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    root = tmp_path_factory.mktemp("plan6")
    csv_path = _csv(root, "verified_tokens,seconds\n1,0.02\n9,0.022\n")
    out = {}
    for name, seconds in (("p", "0.004"), ("q", "0.001")):
        assert profile_cli.main(["--from-csv", str(csv_path), "--draft-seconds", seconds, "--states", str(tiny_cache),
                                 "--out", str(root / f"{name}.json")]) == 0
    for name, prof, extra in (("a", "p", []), ("b", "q", []), ("c", "p", ["--tail-blocks", "reference"])):
        out[name] = root / name / "r.json"
        assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(out[name]),
                              "--ddtree-budgets", "8", "--profile", str(root / f"{prof}.json"), *extra]) == 0
    return out


def test_serve_plan_compares_profiles_by_identity_not_by_label(planned, tmp_path, capsys) -> None:
    from dflash_cb.integrations.cli import serve_plan as serve_plan_cli

    a, b = json.loads(planned["a"].read_text()), json.loads(planned["b"].read_text())
    assert a["breakdown"]["serving"]["profile"] == b["breakdown"]["serving"]["profile"]  # the labels read the same
    code = run(serve_plan_cli.main, [str(planned["a"]), str(planned["b"]), "--out", str(tmp_path / "plan")])
    _error(code, capsys, "different profiles", "hold other numbers")
    assert not (tmp_path / "plan.md").exists()


def test_serve_plan_warns_where_compare_results_does(planned, tmp_path) -> None:
    from dflash_cb.integrations.cli import serve_plan as serve_plan_cli

    with pytest.warns(UserWarning, match="tail_blocks differ"):
        assert serve_plan_cli.main([str(planned["a"]), str(planned["c"]), "--out", str(tmp_path / "plan")]) == 0
    assert "tail_blocks differ" in (tmp_path / "plan.md").read_text()


@pytest.mark.parametrize("case,words", [
    ("damaged", ["damaged", "score it again"]),
    ("blank_label", ["blank"]),
    ("same_file", ["given twice"]),
])
def test_serve_plan_refuses_in_one_line(planned, tmp_path, capsys, case, words) -> None:
    from dflash_cb.integrations.cli import serve_plan as serve_plan_cli

    files, extra = [str(planned["a"]), str(planned["c"])], []
    if case == "damaged":
        data = json.loads(planned["a"].read_text())
        del data["breakdown"]["serving"]["settings"][0]["speedup"]
        (tmp_path / "bad.json").write_text(json.dumps(data))
        files[0] = str(tmp_path / "bad.json")
    elif case == "blank_label":
        extra = ["--labels", "a,"]
    else:
        files[1] = files[0]
    code = run(serve_plan_cli.main, [*files, *extra, "--out", str(tmp_path / "plan")])
    _error(code, capsys, *words)


# -- eval_drafter --speculative-tokens: the cap and the profile's rows named rightly ----------------------------------

@pytest.fixture(scope="module")
def mtp_world(mtp_target, tmp_path_factory) -> dict:
    """A cache of the MTP target's last layer and its head extracted as a drafter folder."""
    from tiny_target import random_prompts, write_prompts

    from dflash_cb.cache.precompute import main as precompute
    from dflash_cb.integrations.cli import extract as extract_cli

    root = tmp_path_factory.mktemp("mtpworld6")
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(3, (4, 8), seed=5, vocab=120))
    n = json.loads((mtp_target / "config.json").read_text())
    layers = int((n.get("text_config") or n)["num_hidden_layers"])
    assert precompute(["--target", str(mtp_target), "--prompts", str(prompts), "--out", str(root / "cache"),
                       "--reference", "local", "--dtype", "float32", "--max-new-tokens", "12", "--no-progress",
                       "--layers", str(layers - 1)]) == 0
    assert extract_cli.main(["--mtp-from", str(mtp_target), "--out", str(root / "mtp")]) == 0
    return {"cache": root / "cache", "drafter": root / "mtp", "root": root}


@pytest.mark.parametrize("ks,rows,words", [
    ("16", "1,0.02\n20,0.03\n", ["--speculative-tokens 16", "1 to 15"]),
    ("1,16", "1,0.02\n20,0.03\n", ["--speculative-tokens 1,16", "1 to 15"]),
    ("1,3", "1,0.02\n2,0.021\n", ["chain K=3 verifies 4 tokens", "up to 2", "smaller --speculative-tokens"]),
])
def test_chain_lengths_refused_naming_the_right_cap(mtp_world, tmp_path, capsys, ks, rows, words) -> None:
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    prof = _profile(tmp_path, rows, "p.json", "--states", str(mtp_world["cache"]))
    code = run(eval_cli.main, ["--states", str(mtp_world["cache"]), "--drafter", str(mtp_world["drafter"]), "--out",
                               str(tmp_path / "r.json"), "--speculative-tokens", ks, "--ddtree-budgets", "",
                               "--profile", str(prof)])
    err = _error(code, capsys, *words)
    assert "--ddtree-budgets" not in err and "--block-size" not in err
    assert not list(tmp_path.glob("r*.json"))


def test_a_profile_without_a_target_or_of_another_batch_is_warned_about(tiny_cache, drafter_dir, tmp_path) -> None:
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    prof = _profile(tmp_path, "1,0.02\n9,0.022\n", "p.json", "--batch-size", "8")
    with pytest.warns(UserWarning) as caught:
        assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out",
                              str(tmp_path / "r.json"), "--ddtree-budgets", "8", "--profile", str(prof)]) == 0
    said = " ".join(str(w.message) for w in caught)
    assert "records no target" in said and "batch of 8" in said


# -- vLLM's per-request counters: consistent with one another --------------------------------------------------------

def _answer(**edit) -> dict:
    spec = {"num_spec_steps": 3, "num_draft_tokens": 9, "num_accepted_draft_tokens": 4, "num_spec_tokens": 3,
            "acceptance_histogram": [1, 1, 0, 1], "per_step_accepted": [0, 1, 3]}
    spec.update(edit)
    return {"metrics": {"speculative_decoding": spec}}


@pytest.mark.parametrize("edit,words", [
    ({"per_step_accepted": [0, 3, 3]}, ["per_step_accepted sums to 6", "num_accepted_draft_tokens is 4"]),
    ({"per_step_accepted": [0, 0, 4], "acceptance_histogram": [2, 0, 0, 0, 1], "num_spec_tokens": 3},
     ["accepts 4, above num_spec_tokens 3"]),
    ({"acceptance_histogram": [1, 0, 2]}, ["acceptance_histogram has 3 entries", "needs 4"]),
    ({"num_spec_tokens": 2}, ["num_draft_tokens 9 above num_spec_steps 3 x num_spec_tokens 2"]),
    ({"num_accepted_draft_tokens": 12, "per_step_accepted": None}, ["above num_draft_tokens 9"]),
])
def test_per_request_counters_that_contradict_themselves_are_refused(edit, words) -> None:
    from dflash_cb.cache.vllm_counters import answer_counters

    assert answer_counters(_answer())["per_step_accepted"] == [0, 1, 3]  # a consistent answer reads
    body = _answer(**edit)
    spec = body["metrics"]["speculative_decoding"]
    for k in [k for k, v in spec.items() if v is None]:
        del spec[k]
    with pytest.raises(ValueError) as e:
        answer_counters(body)
    assert all(w in str(e.value) for w in words), str(e.value)


# -- build_prompts ---------------------------------------------------------------------------------------------------

def test_build_prompts_refuses_a_damaged_source_record_and_a_set_named_twice(tmp_path, capsys) -> None:
    from dflash_cb.cache import prompt_sets as PS
    from dflash_cb.cache.build_prompts import main as build_main

    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    (folder / PS.SOURCE_FILE).write_text("{ not json")
    with pytest.raises(PS.PromptSetError, match=r"source.json: not a readable saved set's record.*save the set again"):
        PS.load_set(PS.PAPER.set("gsm8k"), tmp_path / "data")
    code = build_main(["--preset", "dflash-paper", "--sets", "gsm8k,gsm8k", "--save-data", str(tmp_path / "d2")])
    _error(code, capsys, "--sets gsm8k,gsm8k", "more than once")
    assert not (tmp_path / "d2").exists()


# -- a profile used where its rows do not fit: flagged rows, contexts never reached, a pass of another block -------

def _measured(tmp_path: Path, tiny_cache: Path, drafter_dir: Path | None = None, **edit) -> Path:
    """A CSV profile rewritten as a measured one (contexts, flags, the drafter it timed), as profile_costs writes."""
    from dflash_cb.core.checkpoints.load import load_drafter
    from dflash_cb.integrations.evaluator.projection import drafter_identity

    data = json.loads(_profile(tmp_path, "1,0.02\n9,0.022\n", "m.json", "--states", str(tiny_cache)).read_text())
    data.update(kind="measured", verify={"16": [[1, 0.02], [9, 0.022]]}, draft={"16": 0.004})
    if drafter_dir is not None:
        data["drafter"] = drafter_identity(load_drafter(drafter_dir))
    data.update(edit)
    out = tmp_path / "measured.json"
    out.write_text(json.dumps(data))
    return out


def test_rows_flagged_when_measured_are_warned_about_at_use(tiny_cache, drafter_dir, tmp_path) -> None:
    """A profile measured beside a busy process keeps the rows that stayed unstable, flagged: their use is said."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    flag = "context 16: 9 tokens: repeats spread 80% of the median (more than 50%), after measuring again"
    prof = _measured(tmp_path, tiny_cache, flags=[flag])
    with pytest.warns(UserWarning, match="rows flagged when it was measured.*9 tokens.*measure again on an idle"):
        assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out",
                              str(tmp_path / "r.json"), "--ddtree-budgets", "", "--profile", str(prof)]) == 0


def test_rows_measured_only_at_contexts_the_cache_never_reaches_are_warned_about(tiny_cache, drafter_dir,
                                                                                  tmp_path) -> None:
    from dflash_cb.cache.states import StateCache
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.evaluator.projection import cache_contexts

    lo, hi = cache_contexts(StateCache(tiny_cache))
    prof = _measured(tmp_path, tiny_cache, verify={"8192": [[1, 0.02], [9, 0.022]]}, draft={"8192": 0.004})
    with pytest.warns(UserWarning, match=f"contexts 8192 to 8192 only, the cache's cycles run at contexts {lo} to "
                                         f"{hi}.*--contexts {lo},{hi}"):
        assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out",
                              str(tmp_path / "r.json"), "--ddtree-budgets", "", "--profile", str(prof)]) == 0


def test_a_pass_timed_at_the_drafters_block_is_not_used_for_another_block(tiny_cache, drafter_dir, tmp_path,
                                                                           capsys) -> None:
    """--block-size 4 on a block-6 drafter: the profile's pass is the block-6 one; refused, not priced with it."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    prof = _measured(tmp_path, tiny_cache, drafter_dir)
    code = run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out",
                               str(tmp_path / "r.json"), "--ddtree-budgets", "", "--block-size", "4",
                               "--profile", str(prof)])
    _error(code, capsys, "timed at block 6", "drafts blocks of 4", "--block-size 6", "block-4 pass")
    assert not (tmp_path / "r.json").exists()


def test_rows_short_of_the_block_name_the_block_option(tiny_cache, drafter_dir, tmp_path, capsys) -> None:
    """Rows to 4 tokens for a block-6 drafter: the fix is a smaller block (or more rows), not --ddtree-budgets; the
    live evaluator names its own field (block_size=)."""
    from dflash_cb.core.checkpoints.load import load_drafter
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.evaluator.projection import checked_settings, read_profile

    prof = _profile(tmp_path, "1,0.02\n4,0.022\n", "p.json", "--states", str(tiny_cache))
    code = run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out",
                               str(tmp_path / "r.json"), "--ddtree-budgets", "", "--profile", str(prof)])
    err = _error(code, capsys, "block 6 verifies 6 tokens", "up to 4", "--block-size 4")
    assert "--ddtree-budgets" not in err
    with pytest.raises(Exception, match=r"set block_size=4") as e:
        checked_settings(read_profile(prof), load_drafter(drafter_dir), 6, (), "live: cost_profile=p.json",
                         "lower ddtree_budgets=", "block_size=")
    assert "--block-size" not in str(e.value) and "--ddtree-budgets" not in str(e.value)


# -- Domino and DSpark folders: the config read against the weights ----------------------------------------------

def _head_folder(tmp_path: Path, tiny_cache: Path, family: str, edit) -> Path:
    """A tiny drafter folder of a head family (random weights) whose config.json ``edit`` changes."""
    from tiny_target import TINY_LAYER_IDS, TINY_MASK

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    m = StateCache(tiny_cache).manifest
    torch.manual_seed(0)
    out = tmp_path / family
    drafter_from_config(tiny_drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_LAYER_IDS,
                                            TINY_MASK, block_size=6, family=family)).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _as_dspark(cfg: dict) -> None:
    from dflash_cb.core.drafters.dspark.model import ARCHITECTURE

    cfg["architectures"] = [ARCHITECTURE]
    cfg["dflash_config"]["projector_type"] = "dspark"


@pytest.mark.parametrize("family,edit,words", [
    ("dspark", lambda c: c.pop("block_size"), ["config.json", "without block_size", "add \"block_size\": N"]),
    ("domino", lambda c: c.pop("block_size"), ["config.json", "without block_size"]),
    ("dspark", lambda c: c["dflash_config"].pop("markov_head_type"),
     ["config.json", "no markov_head_type", "gated Markov head", "markov_head_type 'gated'"]),
    ("domino", _as_dspark, ["config.json", "the weights are a Domino drafter's", "config says DSpark",
                            "DominoDraftModel"]),
])
def test_a_head_family_config_that_does_not_describe_its_weights_is_refused(tiny_cache, tmp_path, family, edit,
                                                                            words) -> None:
    """A DSpark config without block_size (16 would be a guess), without the markov_head_type its weights hold, or
    a Domino folder labelled DSpark: one line naming config.json, the field and the fix."""
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    folder = _head_folder(tmp_path, tiny_cache, family, edit)
    with pytest.raises(CheckpointError) as e:
        load_drafter(folder)
    assert all(w in str(e.value) for w in words), str(e.value)


# -- a model folder given where another input or an output goes -------------------------------------------------

def test_a_drafter_folder_as_target_is_named_as_one(tiny_cache, drafter_dir, tmp_path, capsys) -> None:
    """--target a drafter folder: said so (not 'weights missing, re-download', and no roofline of the drafter)."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    for extra in ([], ["--roofline", "--bandwidth-gbs", "100", "--peak-tflops", "1"]):
        code = run(profile_cli.main, ["--target", str(drafter_dir), "--drafter", str(drafter_dir), *extra,
                                      "--out", str(tmp_path / "p.json")])
        _error(code, capsys, f"--target {drafter_dir}: a drafter's folder", "the drafter goes to --drafter")
        assert not (tmp_path / "p.json").exists()
    code = run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--target",
                               str(drafter_dir), "--ddtree-budgets", "", "--out", str(tmp_path / "r.json")])
    _error(code, capsys, "a drafter's folder", "the target's own folder")


def test_out_a_model_folder_is_not_answered_with_a_path_inside_it(tiny_cache, drafter_dir, tmp_path, capsys) -> None:
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    target = tiny_cache.parent / "target"
    code = run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--ddtree-budgets", "",
                               "--out", str(target)])
    err = _error(code, capsys, f"--out {target}: is a model folder", "outside it")
    assert f"{target}/results.json" not in err


# -- served counters: what a line says of them ------------------------------------------------------------------

def _entry(spec: dict, completion: int = 24):
    from types import SimpleNamespace

    return SimpleNamespace(served_spec=spec, prompt_len=8, completion_len=completion, valid_len=8 + completion,
                           total_len=8 + completion, id="s0", category="c")


def test_a_completion_without_a_verify_round_is_said_to_be_unspeculated(tmp_path) -> None:
    """num_spec_steps 0 for a 24-token completion: not 'e.g. a completion of one token' but what it is."""
    from dflash_cb.cache import served
    from dflash_cb.cache.vllm_counters import answer_counters

    spec = answer_counters(_answer(num_spec_steps=0, num_draft_tokens=0, num_accepted_draft_tokens=0,
                                   acceptance_histogram=[0, 0, 0, 0], per_step_accepted=[]))
    kind, why = served.comparability(_entry(spec))
    assert kind == served.SKIPPED and why.startswith("not speculated: num_spec_steps 0 for a 24-token completion")
    assert "one token" not in why
    assert "one token" in served.comparability(_entry(spec, completion=1))[1]  # one token: no round to have


def test_an_answers_chain_length_other_than_the_servers_is_said(tmp_path) -> None:
    from dflash_cb.cache import served
    from dflash_cb.cache.vllm_counters import SPEC_TOKENS, answer_counters

    spec = answer_counters(_answer())
    assert spec[SPEC_TOKENS] == 3
    assert served.comparability(_entry(spec, 8), block_size=4) is None  # K 3: blocks of 4, as recorded
    kind, why = served.comparability(_entry(spec, 8), block_size=6)
    assert kind == served.SKIPPED and "num_spec_tokens is 3, the server's recorded configuration says 5" in why


def test_per_request_counters_are_not_described_as_server_wide_deltas(served_world, tmp_path, capsys) -> None:
    """Well-formed detailed per-request counters: the convention line says they are each answer's own."""
    from served_world import BLOCK, precompute, served_run
    from vllm_server import FakeVLLM, Run, serve

    from dflash_cb.cache import vllm_counters as V
    from dflash_cb.core.results.results_file import load_results
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    def loop(prompt, max_tokens, stops):
        r = served_run(served_world, prompt, max_tokens, stops, BLOCK)
        return Run(r.output_ids, r.correct_drafts)

    fake = FakeVLLM(loop, served_name="tiny-target", root=str(served_world["target_dir"]), num_spec_tokens=BLOCK - 1,
                    drafter=str(served_world["drafter"]), per_request="detailed")
    with serve(fake) as url:
        assert precompute("--target", str(served_world["target_dir"]), "--prompts", str(served_world["prompts"]),
                          "--out", str(tmp_path / "c"), "--reference", "vllm", "--vllm-url", url) == 0
    capsys.readouterr()
    assert run(eval_cli.main, ["--states", str(tmp_path / "c"), "--drafter", str(served_world["drafter"]), "--out",
                               str(tmp_path / "r.json"), "--ddtree-budgets", "", "--served-check"]) == 0
    out = capsys.readouterr().out
    assert "server-wide counters" not in out and "each answer's own counters" in out
    assert load_results(tmp_path / "r.json").breakdown["served_check"]["convention"] == V.REQUEST_CONVENTION


# -- build_prompts ------------------------------------------------------------------------------------------------

def test_an_mt_bench_prompt_that_is_a_string_is_one_turn() -> None:
    from dflash_cb.cache import prompt_sets as PS

    fmt = PS.PAPER.set("mt-bench").format
    assert fmt({"prompt": "Write a poem."}) == ["Write a poem."]  # not a turn per character
    assert fmt({"prompt": ["a", "b"]}) == ["a", "b"]


# -- compare_results across blocks and chain lengths ----------------------------------------------------------------

def test_compare_across_blocks_says_why_tau_does_not_rank_them(tiny_cache, drafter_dir, mtp_world, tmp_path,
                                                               capsys) -> None:
    """Blocks 6 and 4 of one drafter, or an MTP head at K=1 and K=3, side by side: a comparison of blocks (tau grows
    with the block; the projected speedup chooses one), not 'not like for like, score with the same --block-size'."""
    from dflash_cb.integrations.cli import compare as compare_cli
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    base = ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--ddtree-budgets", ""]
    assert run(eval_cli.main, [*base, "--out", str(tmp_path / "b6.json")]) == 0
    assert run(eval_cli.main, [*base, "--out", str(tmp_path / "b4.json"), "--block-size", "4"]) == 0
    assert run(eval_cli.main, ["--states", str(mtp_world["cache"]), "--drafter", str(mtp_world["drafter"]),
                               "--ddtree-budgets", "", "--speculative-tokens", "1,3", "--out",
                               str(tmp_path / "k.json")]) == 0
    capsys.readouterr()
    for files, words in (((tmp_path / "b6.json", tmp_path / "b4.json"), ["block_size differ (b6 6, b4 4)",
                                                                          "--block-size to compare drafters"]),
                         ((tmp_path / "k.k1.json", tmp_path / "k.k3.json"), ["chain lengths K differ (k.k1 1, k.k3 3)",
                                                                             "--speculative-tokens"])):
        assert run(compare_cli.main, [*map(str, files), "--out", str(tmp_path / "cmp"), "--resamples", "20"]) == 0
        err = capsys.readouterr().err
        assert all(w in err for w in [*words, "tau grows with the", "projected speedup"]), err
        assert "not like for like" not in err


# -- sweep --------------------------------------------------------------------------------------------------------

def test_a_sweep_out_that_is_a_checkpoint_folder_is_named_as_one(tiny_cache, drafter_dir, tmp_path, capsys) -> None:
    """--out another checkpoint's folder: said to be one, not 'holds config.json ... choose a new folder (or an
    earlier sweep's)'; nothing written into it (one the PATHs match is refused as a checkpoint already)."""
    from dflash_cb.integrations.cli import sweep_cli

    for step in (100, 200):
        shutil.copytree(drafter_dir, tmp_path / "run" / f"checkpoint-{step}")
    out = tmp_path / "run" / "checkpoint-200"
    before = sorted(p.name for p in out.iterdir())
    code = run(sweep_cli.main, [str(tmp_path / "run" / "checkpoint-100"), "--states", str(tiny_cache), "--out",
                                str(out)])
    _error(code, capsys, f"--out {out}: is a checkpoint folder", "config.json", "a new folder")
    assert sorted(p.name for p in out.iterdir()) == before
