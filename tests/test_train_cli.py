"""`prisme train --set FIELD=VALUE`: any stage or model field from the command line, type-checked with the field
named; a preset that would silently replace a config's model is refused."""

from __future__ import annotations

import json

import torch
from test_run_safety import run_cli

from prisme import checkpoint as ckpt
from prisme.config import PrismeConfig

BASE = ["train", "--stage", "backbone", "--dataset", "mqar", "--steps", "2", "--batch-size", "4", "--no-progress"]


def test_set_changes_stage_and_model_fields(tmp_path):
    out = tmp_path / "run"
    rc, _ = run_cli(*BASE, "--preset", "tiny", "--out", str(out), "--set", "warmup=1", "--set", "lr=0.02",
                    "--set", 'mqar={"vocab_size": 64, "seq_len": 16, "n_pairs": 2, "query_min_pos": 4}',
                    "--set", "model.d_model=48", "--set", "model.n_layer=1")
    assert rc == 0
    meta = ckpt.read_meta(out)
    assert meta.stage_config["warmup"] == 1 and meta.stage_config["lr"] == 0.02
    want = PrismeConfig.from_name("tiny", d_model=48, n_layer=1)
    assert (meta.config.d_model, meta.config.n_layer) == (48, 1)
    assert meta.config.ffn_hidden == want.ffn_hidden != PrismeConfig.from_name("tiny").ffn_hidden  # derived anew


def test_a_bad_set_names_the_field_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    for item, words in (("nosuch=1", ["StageConfig has no field 'nosuch'"]),
                        ("d_model=32", ["no field 'd_model'", "model."]),
                        ("steps=abc", ["steps"]),
                        ("model.nosuch=1", ["PrismeConfig has no field 'nosuch'"]),
                        ("model.d_model=30", ["d_model"]),  # not divisible by the head count
                        ("warmup", ["FIELD=VALUE"])):
        rc, _ = run_cli(*BASE, "--preset", "tiny", "--out", str(out), "--set", item)
        err = capsys.readouterr().err
        assert rc == 2 and all(w in err for w in words), (item, err)
        assert not out.exists()


def test_rebase_holds_the_run_folder_lock_from_its_first_write(tmp_path, capsys, monkeypatch):
    """`--rebase` writes the rebased start into the run folder: another run must already be locked out then (it was
    taken only when training began), and the lock is released at the end. Negative control: an unlocked folder."""
    import prisme.rebase
    from prisme.training.resume import RunLock

    mqar = 'mqar={"vocab_size": 64, "seq_len": 16, "n_pairs": 2, "query_min_pos": 4}'
    assert run_cli(*BASE, "--preset", "tiny", "--set", mqar, "--out", str(tmp_path / "b"))[0] == 0
    real, seen = prisme.rebase.rebase, []

    def rebase_and_probe(src, cfg, folder, **kw):
        for out in (tmp_path / "w", tmp_path / "free"):  # the second is the control: nobody holds it
            try:
                RunLock(out).release()
                seen.append((out.name, "free"))
            except ValueError as e:
                seen.append((out.name, "in use" if "in use by" in str(e) else str(e)))
        return real(src, cfg, folder, **kw)

    monkeypatch.setattr(prisme.rebase, "rebase", rebase_and_probe)
    rc, _ = run_cli("train", "--stage", "workspace", "--init-from", str(tmp_path / "b"), "--dataset", "mqar",
                    "--steps", "1", "--batch-size", "4", "--no-progress", "--set", mqar, "--preset", "tiny",
                    "--set", "model.bank_source=embedding", "--out", str(tmp_path / "w"), "--rebase")
    assert rc == 0 and seen == [("w", "in use"), ("free", "free")]
    RunLock(tmp_path / "w").release()  # released after training


def test_a_preset_beside_a_configs_model_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"preset": "tiny", "vocab_size": 300}, "stage": "backbone", "steps": 1}))
    rc, _ = run_cli("train", "--config", str(cfg), "--preset", "demo", "--out", str(tmp_path / "r"))
    assert rc == 2 and "both name the model" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_rebase_starts_a_new_workspace_design_from_a_trained_backbone(tmp_path, capsys):
    """`--init-from BACKBONE --rebase` with another bank source: the stage trains on the same (frozen) backbone
    weights; without `--rebase` the mismatch is an error that names the option."""
    mqar = 'mqar={"vocab_size": 64, "seq_len": 16, "n_pairs": 2, "query_min_pos": 4}'
    assert run_cli(*BASE, "--preset", "tiny", "--set", mqar, "--out", str(tmp_path / "b"))[0] == 0
    ws = ["train", "--stage", "workspace", "--init-from", str(tmp_path / "b"), "--dataset", "mqar", "--steps", "2",
          "--batch-size", "4", "--no-progress", "--set", mqar, "--preset", "tiny",
          "--set", "model.bank_source=embedding"]
    rc, _ = run_cli(*ws, "--out", str(tmp_path / "plain"))
    assert rc == 2 and "--rebase" in capsys.readouterr().err
    rc, _ = run_cli(*ws, "--out", str(tmp_path / "b"), "--rebase")  # a folder that holds a run: refused first
    assert rc == 2 and "already holds a run" in capsys.readouterr().err
    assert not (tmp_path / "b" / "0_rebased_init").exists()
    rc, _ = run_cli(*ws, "--out", str(tmp_path / "w"), "--rebase", "--seed", "7")
    assert rc == 0 and "with seed 7" in capsys.readouterr().err
    new, meta = ckpt.load_model(tmp_path / "w")
    old = ckpt.load_model(tmp_path / "b")[0]
    assert meta.config.bank_source == "embedding" and meta.stage == "workspace"
    assert all(torch.equal(a, b) for a, b in zip(new.backbone.state_dict().values(),
                                                 old.backbone.state_dict().values()))
