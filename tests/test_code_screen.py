"""`prisme study code-screen`: the machinery on untrained code backbones (saved as finished, so nothing long trains):
a zero-training read, a learned copy head and the workspace design trained for two steps each, every row scored on
fixed subsets with its paired differences, capture and seen-miss rise. What is checked is the machinery, with values
that must hold for any backbone: the exact copy lowers an untrained model's loss on code, a row against itself is no
difference, and a design's own run is what its row scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prisme.checkpoint import TrainingState, checkpoint_name, save_checkpoint
from prisme.model.prisme import PrismeModel
from prisme.studies.code_screen import DESIGNS, ScreenConfig, format_screen, run_screen, twins


@pytest.fixture(scope="module")
def screened(tmp_path_factory):
    root = tmp_path_factory.mktemp("screen")
    cfg = ScreenConfig(designs=["reference", "cache", "copy_stream", "workspace", "workspace_joint", "copy_more"],
                       out_dir=str(root / "screen"),
                       backbones=str(root / "bb"), val_windows=2, held_out_windows=2, steps=2, workspace_steps=2,
                       bootstrap_samples=50, progress=False)
    for model_cfg, scfg in twins(cfg).values():  # untrained backbones recorded as finished: the cache reads them
        torch.manual_seed(0)
        save_checkpoint(f"{scfg.out_dir}/{checkpoint_name(scfg.steps)}", PrismeModel(model_cfg),
                        TrainingState("backbone", scfg.steps, stage_config=scfg.to_dict()))
    return cfg, run_screen(cfg)


def test_the_screen_scores_every_design_against_the_window_model_the_reference_and_the_global_twin(screened):
    cfg, doc = screened
    rows = doc["rows"]
    assert set(rows) == {"window", "global", "window+reference", "global+reference", "window+cache", "global+cache",
                         "window+copy_stream", "global+copy_stream", "window+workspace", "window+workspace_joint",
                         "window+copy_more"}  # the workspace designs: window only
    for key, r in rows.items():
        for split in ("val", "held_out"):
            d = r[split]
            assert torch.isfinite(torch.tensor(d["loss"])) and abs(sum(d["share"].values()) - 1) < 1e-6
            if key != "window":
                assert "vs window" in d  # every row against the window model alone, paired
    # the untrained exact copy takes an untrained model's loss on code down (it copies what followed a match)
    assert rows["window+reference"]["held_out"]["vs window"]["hi"] < 0
    assert "vs window+reference" not in rows["window+reference"]["held_out"]  # not against itself
    assert rows["window"]["held_out"]["seen_miss_rise"] == 0.0  # the window model's own rise: none
    assert rows["window+workspace"]["relative_ops"] > rows["window+copy_stream"]["relative_ops"] > 1.0
    assert json.loads((Path(cfg.out_dir) / "screen.json").read_text())["rows"].keys() == rows.keys()
    assert "window+workspace" in format_screen(doc)


def test_a_design_trains_once_and_its_checkpoint_is_what_its_row_scores(screened):
    """A second screen of the same folder trains nothing again (the runs are read back) and scores the same."""
    cfg, doc = screened
    ckpt = doc["rows"]["window+copy_stream"]["checkpoint"]
    assert ckpt is not None and "copy_stream_window" in ckpt
    again = run_screen(ScreenConfig(**{**cfg.__dict__, "designs": ["copy_stream"]}))
    assert again["rows"]["window+copy_stream"]["held_out"]["loss"] == doc["rows"]["window+copy_stream"]["held_out"][
        "loss"]


def test_unknown_designs_and_bad_counts_are_refused():
    with pytest.raises(ValueError, match="--designs must name designs from"):
        ScreenConfig(designs=["copy", "bogus"]).validate()
    with pytest.raises(ValueError, match="steps"):
        ScreenConfig(steps=0).validate()
    assert "copy_wide" in DESIGNS and not DESIGNS["copy_wide"].frontier  # the gate that sees more: window only


def test_the_joint_workspace_trains_the_backbone_and_is_paired_with_its_control(screened):
    """workspace_joint: the backbone learns in the workspace stage (in the workspace design it stays frozen: the
    negative control), and its row carries the paired difference to copy_more, the same bytes given to the backbone,
    printed under the table."""
    from prisme.checkpoint import load_model

    cfg, doc = screened
    rows = doc["rows"]

    def block0(key: str, stage: str) -> torch.Tensor:
        run = Path(rows[key]["checkpoint"]).parent / stage  # the design's folder
        return load_model(run)[0].backbone.blocks[0].attn.wqkv.weight.detach().clone()

    assert torch.equal(block0("window+workspace", "copy"), block0("window+workspace", "workspace"))  # frozen
    assert not torch.equal(block0("window+workspace_joint", "copy"), block0("window+workspace_joint", "workspace"))
    assert not torch.equal(block0("window+copy_more", "copy"), block0("window+copy_more", "more"))
    d = rows["window+workspace_joint"]["held_out"]["vs window+copy_more"]
    assert d["lo"] <= d["mean"] <= d["hi"] and rows["window+workspace_joint"]["control"] == "window+copy_more"
    assert rows["window+workspace_joint"]["relative_ops"] > rows["window+copy_more"]["relative_ops"]
    assert "window+workspace_joint minus window+copy_more: held-out" in format_screen(doc)
