"""tools/extract_drafter.py on a real Lightning checkpoint: loads in both loaders, scores identically."""

from __future__ import annotations

from pathlib import Path

import oracles
import pytest
import torch

from dflash_cb.common.cli import run
from dflash_cb.integrations.cli import extract as extract_drafter


def extract(*argv: str) -> int:
    """The tool as a user runs it: ``run(main)`` turns user errors into one line and exit code 2."""
    return run(extract_drafter.main, list(argv))


@pytest.fixture(scope="module")
def lightning_ckpt(tiny_cache: Path, tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule

    seed_everything(0)
    root = tmp_path_factory.mktemp("extract")
    ckpt = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, every_n_train_steps=4)
    trainer = Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ckpt], default_root_dir=root)
    module = DFlashDrafterModule(tiny_drafter_config, str(tiny_cache))
    trainer.fit(module, CachedStatesDataModule(str(tiny_cache), batch_size=2))
    return Path(ckpt.last_model_path)


@pytest.mark.e2e
def test_extract_loads_in_both_and_scores_identically(lightning_ckpt: Path, tiny_cache: Path, tmp_path: Path) -> None:
    DFlashDraftModel = oracles.require("dflash.model").DFlashDraftModel
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate

    out = tmp_path / "drafter"
    assert extract_drafter.main(["--ckpt", str(lightning_ckpt), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    ours = DFlashDrafter.from_pretrained(out).eval()
    ref = DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    # The weights are the checkpoint's, not a fresh initialisation.
    state = torch.load(lightning_ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert torch.equal(ours.fc.weight, state["drafter.fc.weight"])
    assert torch.equal(ref.fc.weight, state["drafter.fc.weight"])
    cache = StateCache(tiny_cache)
    a = evaluate(cache, ours, budgets=(4, 8))
    b = evaluate(cache, ref, budgets=(4, 8))
    assert [s.acceptance_lengths for s in a.samples] == [s.acceptance_lengths for s in b.samples]
    assert [s.ddtree for s in a.samples] == [s.ddtree for s in b.samples]


@pytest.mark.e2e
def test_extract_reports_the_checkpoints_global_step(lightning_ckpt: Path, tmp_path: Path) -> None:
    """The demo's results.json provenance takes the step from here (the checkpoint is read once)."""
    from dflash_cb.core.checkpoints.load import extract_drafter as extract_folder

    info = extract_folder(lightning_ckpt, tmp_path / "drafter")
    assert info["global_step"] == 4  # the fixture trains max_steps=4 and keeps the last checkpoint


@pytest.mark.e2e
def test_extract_refuses_incomplete_or_unsafe(lightning_ckpt: Path, tiny_drafter_config: dict, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    import json

    ckpt = torch.load(lightning_ckpt, map_location="cpu", weights_only=True)
    del ckpt["state_dict"]["drafter.layers.0.mlp.up_proj.weight"]
    broken = tmp_path / "broken.ckpt"
    torch.save(ckpt, broken)
    assert extract("--ckpt", str(broken), "--out", str(tmp_path / "x")) == 2
    assert "no key prefix holds a complete drafter" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # With the prefix forced, the missing key is named.
    assert extract("--ckpt", str(broken), "--out", str(tmp_path / "x"), "--prefix", "drafter.") == 2
    assert "layers.0.mlp.up_proj.weight" in capsys.readouterr().err

    import argparse

    # Any object that is not a tensor or a plain container must not be unpickled.
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": ckpt["state_dict"], "extra": argparse.Namespace(x=1)}, unsafe)
    assert extract("--ckpt", str(unsafe), "--out", str(tmp_path / "y")) == 2
    err = capsys.readouterr().err
    assert "argparse.Namespace" in err and "never unpickles" in err and "weights_only=False" not in err

    # A plain state dict under another prefix, with the config given explicitly.
    plain = {"model.draft." + k[len("drafter."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    plain["model.draft.layers.0.mlp.up_proj.weight"] = torch.zeros(
        tiny_drafter_config["intermediate_size"], tiny_drafter_config["hidden_size"])
    torch.save(plain, tmp_path / "plain.pt")
    (tmp_path / "cfg.json").write_text(json.dumps(tiny_drafter_config))
    assert extract("--ckpt", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "z"),
                   "--config", str(tmp_path / "cfg.json")) == 0
    assert "'model.draft.'" in capsys.readouterr().out


# -- robustness --------------------------------------------------------------------------------

@pytest.mark.e2e
def test_out_never_deletes_what_the_tool_did_not_create(lightning_ckpt: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """A project folder given as --out survives (refused, or with --overwrite only gains the two
    drafter files); the folder holding --ckpt is refused even with --overwrite; a drafter folder is replaced."""
    import shutil

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    assert extract("--ckpt", str(lightning_ckpt), "--out", str(project)) == 2
    assert "not a drafter folder" in capsys.readouterr().err
    assert sorted(p.name for p in project.iterdir()) == ["train.py"]
    assert extract("--ckpt", str(lightning_ckpt), "--out", str(project), "--overwrite") == 0
    assert sorted(p.name for p in project.iterdir()) == ["config.json", "model.safetensors", "train.py"]
    assert (project / "train.py").read_text() == "print('mine')\n"

    ckpts = tmp_path / "ckpts"
    shutil.copytree(lightning_ckpt.parent, ckpts)
    before = sorted(p.name for p in ckpts.iterdir())
    for extra in ([], ["--overwrite"]):
        assert extract("--ckpt", str(ckpts / lightning_ckpt.name), "--out", str(ckpts), *extra) == 2
        assert f"--out {ckpts}: contains --ckpt" in capsys.readouterr().err
    assert sorted(p.name for p in ckpts.iterdir()) == before

    drafter = tmp_path / "drafter"
    assert extract("--ckpt", str(lightning_ckpt), "--out", str(drafter)) == 0
    first = (drafter / "model.safetensors").stat().st_ino
    assert extract("--ckpt", str(lightning_ckpt), "--out", str(drafter)) == 0  # an earlier drafter: replaced
    assert sorted(p.name for p in drafter.iterdir()) == ["config.json", "model.safetensors"]
    assert (drafter / "model.safetensors").stat().st_ino != first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporaries left


@pytest.mark.e2e
def test_bad_inputs_are_one_line_errors(lightning_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Not a checkpoint / truncated / a file as --out / a bad --config: one line naming
    the file, exit 2, never torch's advice to retry with weights_only=False."""
    import random

    data, noise = lightning_ckpt.read_bytes(), random.Random(0).randbytes(4095)
    cases = {
        "random.ckpt": (b"\x13" + noise, "not a PyTorch checkpoint"),
        "random_proto.ckpt": (b"\x80\xcd" + noise, "not a PyTorch checkpoint"),  # PROTO, no protocol torch reads
        "random_pickle.ckpt": (b"\x80\x02" + noise, "the weights-only reader stopped at: "),
        "text.ckpt": (b"epoch: 3\nloss: 0.1\n", "not a PyTorch checkpoint"),
        "truncated.ckpt": (data[: len(data) // 2], "truncated or damaged"),
        "truncated.safetensors": (b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", "not a readable safetensors"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        assert extract("--ckpt", str(tmp_path / name), "--out", str(tmp_path / "d")) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        assert message in err and str(tmp_path / name) in err and "weights_only=False" not in err, err
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out in (a_file, a_file / "sub"):
        assert extract("--ckpt", str(lightning_ckpt), "--out", str(out)) == 2
        assert "is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "cfg.json").write_text("{not json")
    assert extract("--ckpt", str(lightning_ckpt), "--out", str(tmp_path / "d"), "--config", str(tmp_path / "cfg.json")) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "cfg.json") in err and "not valid JSON" in err
    assert not (tmp_path / "d").exists()


@pytest.mark.e2e
def test_written_files_get_the_umask_mode(lightning_ckpt: Path, tmp_path: Path) -> None:
    """The written files get the umask's mode (not safetensors' own 0600 inside a 0755 folder)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        assert extract("--ckpt", str(lightning_ckpt), "--out", str(tmp_path / "d")) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "d", *(tmp_path / "d").iterdir()]}
    assert modes == {"d": 0o755, "config.json": 0o644, "model.safetensors": 0o644}


def test_a_sharded_folder_with_a_shard_missing_names_it_and_its_index(tiny_drafter_config: dict, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A Hugging Face folder saved in shards (``huggingface_hub.save_torch_state_dict``, what ``save_pretrained``
    writes past ``max_shard_size``) with one shard gone: the error named no key prefix holding a complete drafter;
    it names the missing shard and the index that lists it. The whole folder extracts as the drafter it was saved
    from."""
    import json

    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
    folder = tmp_path / "checkpoint-7"
    drafter.save_pretrained(folder)  # its config.json
    (folder / "model.safetensors").unlink()
    size = sum(v.numel() * v.element_size() for v in drafter.state_dict().values())
    save_torch_state_dict(drafter.state_dict(), folder, max_shard_size=size // 4)
    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) >= 3, shards
    assert extract("--ckpt", str(folder), "--out", str(tmp_path / "whole")) == 0
    saved = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert saved.keys() == drafter.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in drafter.state_dict().items())
    capsys.readouterr()
    (folder / shards[1]).unlink()
    assert extract("--ckpt", str(folder), "--out", str(tmp_path / "d")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and shards[1] in err and str(index) in err and "missing" in err, err
    assert "no key prefix" not in err and not (tmp_path / "d").exists()
    index.unlink()  # without the index, the shard names still say how many there are
    assert extract("--ckpt", str(folder), "--out", str(tmp_path / "d")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and shards[1] in err and "missing" in err, err
