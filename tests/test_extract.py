"""tools/extract_drafter.py on a real Lightning checkpoint: loads in both loaders, scores identically."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import extract_drafter  # noqa: E402


@pytest.fixture(scope="module")
def lightning_ckpt(tiny_cache: Path, tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dflash_cb.lightning_module import CachedStatesDataModule, DFlashDrafterModule

    seed_everything(0)
    root = tmp_path_factory.mktemp("extract")
    ckpt = ModelCheckpoint(dirpath=root / "ckpts", save_last=True, every_n_train_steps=4)
    trainer = Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ckpt], default_root_dir=root)
    module = DFlashDrafterModule(tiny_drafter_config, str(tiny_cache))
    trainer.fit(module, CachedStatesDataModule(str(tiny_cache), batch_size=2))
    return Path(ckpt.last_model_path)


def test_extract_loads_in_both_and_scores_identically(lightning_ckpt: Path, tiny_cache: Path, tmp_path: Path) -> None:
    from dflash.model import DFlashDraftModel

    from dflash_cb.engine import evaluate
    from dflash_cb.model import DFlashDrafter
    from dflash_cb.states import StateCache

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


def test_extract_refuses_incomplete_or_unsafe(lightning_ckpt: Path, tiny_drafter_config: dict, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    import json

    ckpt = torch.load(lightning_ckpt, map_location="cpu", weights_only=True)
    del ckpt["state_dict"]["drafter.layers.0.mlp.up_proj.weight"]
    broken = tmp_path / "broken.ckpt"
    torch.save(ckpt, broken)
    assert extract_drafter.main(["--ckpt", str(broken), "--out", str(tmp_path / "x")]) == 2
    assert "no key prefix holds a complete DFlash drafter" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # With the prefix forced, the missing key is named.
    assert extract_drafter.main(["--ckpt", str(broken), "--out", str(tmp_path / "x"), "--prefix", "drafter."]) == 2
    assert "layers.0.mlp.up_proj.weight" in capsys.readouterr().err

    import argparse

    # Any object that is not a tensor or a plain container must not be unpickled.
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": ckpt["state_dict"], "extra": argparse.Namespace(x=1)}, unsafe)
    assert extract_drafter.main(["--ckpt", str(unsafe), "--out", str(tmp_path / "y")]) == 2
    assert "weights_only=True" in capsys.readouterr().err

    # A plain state dict under another prefix, with the config given explicitly.
    plain = {"model.draft." + k[len("drafter."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    plain["model.draft.layers.0.mlp.up_proj.weight"] = torch.zeros(
        tiny_drafter_config["intermediate_size"], tiny_drafter_config["hidden_size"])
    torch.save(plain, tmp_path / "plain.pt")
    (tmp_path / "cfg.json").write_text(json.dumps(tiny_drafter_config))
    assert extract_drafter.main(["--ckpt", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "z"),
                                 "--config", str(tmp_path / "cfg.json")]) == 0
    assert "'model.draft.'" in capsys.readouterr().out
