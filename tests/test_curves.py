"""Loss curves: `prisme train` writes RUN/curves.png at the end of a stage, `prisme plot RUN` draws a finished or
running run (a torn last line of metrics.jsonl is skipped), `--tensorboard [DIR]` asks for tensorboard events."""

from __future__ import annotations

import json

import pytest
from test_run_safety import run_cli

from prisme.training.curves import plot_run, read_metrics

TRAIN = ["train", "--dataset", "mqar", "--batch-size", "4", "--seq-len", "16", "--no-progress", "--set",
         'mqar={"vocab_size": 64, "seq_len": 16, "n_pairs": 2, "query_min_pos": 4}', "--set", "eval_every=2",
         "--set", "log_every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("curves")
    assert run_cli(*TRAIN, "--stage", "backbone", "--preset", "tiny", "--steps", "4", "--out", str(root / "b"))[0] == 0
    assert run_cli(*TRAIN, "--stage", "workspace", "--init-from", str(root / "b"), "--steps", "4", "--set",
                   "max_budget=2", "--out", str(root / "w"))[0] == 0
    return root


def test_train_writes_the_stages_curves(runs):
    for stage in ("b", "w"):
        png = runs / stage / "curves.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_metrics(runs / "w")
    assert any(r.get("split") == "val" and "delta_ratio" in r for r in rows)  # the workspace panel has its data


def test_plot_draws_a_running_run_and_names_a_missing_one(runs, tmp_path, capsys):
    metrics = (runs / "b" / "metrics.jsonl").read_text()
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "metrics.jsonl").write_text(metrics + '{"step": 5, "split": "tra')  # being written
    assert len(read_metrics(tmp_path / "live")) == len(metrics.splitlines())
    rc, out = run_cli("plot", str(tmp_path / "live"), "--out", str(tmp_path / "c.png"))
    assert rc == 0 and (tmp_path / "c.png").is_file()
    rc, _ = run_cli("plot", str(tmp_path / "nothing"))
    assert rc == 2 and "metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics row"):
        plot_run(tmp_path / "empty")


def test_tensorboard_flag_sets_the_stage_config(tmp_path, capsys):
    try:
        import torch.utils.tensorboard  # noqa: F401
        have_tb = True
    except ImportError:
        have_tb = False
    rc, _ = run_cli(*TRAIN, "--stage", "backbone", "--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "r"),
                    "--tensorboard", str(tmp_path / "tb"))
    if have_tb:
        assert rc == 0 and any((tmp_path / "tb").iterdir())
        cfg = json.loads((tmp_path / "r" / "stage_config.json").read_text())
        assert cfg["log_tensorboard"] and cfg["tensorboard_dir"] == str(tmp_path / "tb")
    else:  # the extra is named, before anything trains
        assert rc == 2 and "prisme[tb]" in capsys.readouterr().err
