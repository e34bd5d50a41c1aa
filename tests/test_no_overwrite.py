"""No tool writes over a file it reads in the same run: one shared check,
``fileio.check_outputs_apart``, on resolved paths (links followed), before any work."""

from __future__ import annotations

import shutil

import pytest
from tool_runs import folder_digest

from dflash_cb.common.cli import run
from dflash_cb.common.fileio import OverwritesInputError, check_outputs_apart


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)


def test_eval_drafter_out_onto_any_input_file_is_refused_and_the_file_untouched(tiny_cache, drafter_dir, tmp_path,
                                                                                capsys):
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    drafter = tmp_path / "drafter"
    shutil.copytree(drafter_dir, drafter)
    link = tmp_path / "results.json"
    link.symlink_to(cache / "manifest.json")  # a link to an input is that input
    shard = sorted(cache.glob("states-*.safetensors"))[0]
    before = {**folder_digest(cache), **{f"d/{k}": v for k, v in folder_digest(drafter).items()}}
    for out in (cache / "manifest.json", shard, drafter / "config.json", drafter / "model.safetensors", link,
                cache / ".." / "cache" / "manifest.json"):
        code = run(eval_cli.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out),
                                   "--ddtree-budgets", "4", "--device", "cpu"])
        captured = capsys.readouterr()
        one_line_error(code, captured.err, f"--out {out}", "an input of this run", "write --out somewhere else")
        assert "tau (greedy replay)" not in captured.out
    assert {**folder_digest(cache), **{f"d/{k}": v for k, v in folder_digest(drafter).items()}} == before
    # a new file next to the inputs is fine (not an input)
    check_outputs_apart([("--states", cache)], files=[("--out", cache / "results.json")])


def test_compare_extract_merge_precompute_refuse_outputs_over_inputs(tiny_cache, tmp_path, capsys):
    from dflash_cb.cache.precompute import main as precompute_main
    from dflash_cb.cache.precompute import merge_main
    from dflash_cb.integrations.cli import compare as compare
    from dflash_cb.integrations.cli import extract as extract_cli

    # compare_results: --out X writes X.md and X.png; an input named X.md would be overwritten
    a, b = tmp_path / "a.md", tmp_path / "b.json"
    a.write_text("not results")
    b.write_text("{}")
    one_line_error(run(compare.main, [str(a), str(b), "--out", str(tmp_path / "a")]), capsys.readouterr().err,
                   f"--out {tmp_path / 'a.md'}", "results file")
    assert a.read_text() == "not results"
    # extract_drafter: the drafter folder written must not hold the --config read
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    one_line_error(run(extract_cli.main, ["--ckpt", str(tmp_path / "x.ckpt"), "--out", str(folder),
                                          "--config", str(folder / "config.json")]),
                   capsys.readouterr().err, f"--out {folder}: contains --config")
    # merge_states: an --out folder that contains a part would be replaced with the part inside it
    outer = tmp_path / "outer"
    part = outer / "part"
    shutil.copytree(tiny_cache, part)
    before = folder_digest(outer)
    one_line_error(merge_main(["--out", str(outer), "--overwrite", str(part)]), capsys.readouterr().err,
                   f"--out {outer}: contains part")
    assert folder_digest(outer) == before
    # precompute_states: the prompts file inside --out
    prompts = tmp_path / "pc" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text('{"id": "a", "input_ids": [1, 2]}\n')
    one_line_error(precompute_main(["--target", str(tmp_path / "t"), "--prompts", str(prompts), "--out",
                                    str(prompts.parent), "--layers", "0"]),
                   capsys.readouterr().err, f"--out {prompts.parent}: contains --prompts")


def test_the_check_itself():
    with pytest.raises(OverwritesInputError, match="--out /x/y: is --ckpt"):
        check_outputs_apart([("--ckpt", "/x/y")], files=[("--out", "/x/y")])
    with pytest.raises(OverwritesInputError, match="--out /x: contains --ckpt /x/y/z"):
        check_outputs_apart([("--ckpt", "/x/y/z")], folders=[("--out", "/x")])
    check_outputs_apart([("--ckpt", "/x/y"), ("--config", None)], files=[("--out", "/x/yz")], folders=[("--o", "/xy")])
