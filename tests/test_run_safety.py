"""A run folder belongs to one process and loses nothing: the lock, refusing a fresh run over an old one, SIGTERM,
a resume that continues the saved run, complete checkpoints, and untrained parts never used silently.

In-process where it can be; the lock's dead-holder case and the signal test use subprocesses.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from prisme import checkpoint as ckpt
from prisme import cli
from prisme.config import ADDED_CONFIG_FIELDS, PrismeConfig
from prisme.stats import verdict
from prisme.training.config import StageConfig
from prisme.training.resume import RunLock
from prisme.training.trainer import train_stage

T = 16
MQAR = dict(vocab_size=64, seq_len=T, n_pairs=2, query_min_pos=4)


def run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(list(argv))
    return rc, buf.getvalue()


def tiny_run(out: Path, steps: int = 3, **kw) -> StageConfig:
    return StageConfig(**{**dict(stage="backbone", steps=steps, batch_size=4, seq_len=T, out_dir=str(out),
                                 dataset="mqar", mqar=MQAR, progress=False, eval_every=0, eval_batches=1), **kw})


def listing(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its size and mtime (what a refused run must leave as it was; the lock file
    records each holder's pid)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != RunLock.NAME}


# ---------------------------------------------------------------------- one process per run folder
def test_a_second_process_on_a_locked_run_folder_is_refused_naming_the_holder(tmp_path):
    """While a run holds its folder's lock, another run into it is a ValueError naming the holder; nothing changes."""
    out = tmp_path / "run"
    held = RunLock(out)
    try:
        with pytest.raises(ValueError, match=f"in use by process {os.getpid()}"):
            train_stage(PrismeConfig.from_name("tiny"), tiny_run(out))
        assert [p.name for p in out.iterdir()] == [RunLock.NAME]
    finally:
        held.release()
    assert not out.exists()  # the lock made the folder and nothing else was written: it is gone again


def test_the_lock_of_a_dead_holder_is_recovered(tmp_path):
    """A holder killed with SIGKILL (no cleanup at all) does not block the next run: the kernel drops its lock."""
    out = tmp_path / "run"
    code = f"from prisme.training.resume import RunLock; RunLock({str(out)!r}); print('held', flush=True); " \
           f"import time; time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by process {p.pid}"):
            train_stage(PrismeConfig.from_name("tiny"), tiny_run(out))
    finally:
        p.kill()
        p.wait()
    assert train_stage(PrismeConfig.from_name("tiny"), tiny_run(out)).step == 3


@pytest.mark.parametrize("leftover", ["metrics_only", "dangling_latest", "no_latest"])
def test_a_fresh_run_into_a_folder_holding_a_run_refuses_whatever_its_latest_pointer(tmp_path, leftover):
    """A fresh run into a folder with checkpoints or metrics refuses, naming --resume and --overwrite, whether its
    `latest` pointer is there, missing, or names a missing checkpoint; every file stays as it was. With overwrite the
    old run is replaced: no old checkpoint or metrics row is left."""
    out = tmp_path / "run"
    train_stage(PrismeConfig.from_name("tiny"), tiny_run(out, steps=4, ckpt_every=2, log_every=1))
    if leftover == "metrics_only":
        for p in out.glob("ckpt_*"):
            import shutil

            shutil.rmtree(p)
        (out / ckpt.LATEST).unlink()
    elif leftover == "dangling_latest":
        (out / ckpt.LATEST).write_text("ckpt_00000099\n")
    else:
        (out / ckpt.LATEST).unlink()
    before = listing(out)
    with pytest.raises(ValueError, match="already holds a run.*--resume.*--overwrite"):
        train_stage(PrismeConfig.from_name("tiny"), tiny_run(out, steps=2, seed=9))
    assert listing(out) == before
    res = train_stage(PrismeConfig.from_name("tiny"), tiny_run(out, steps=2, seed=9, overwrite=True))
    assert res.step == 2 and sorted(p.name for p in out.glob("ckpt_*")) == [ckpt.checkpoint_name(2)]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and max(steps) == 2


def test_two_concurrent_cli_runs_into_one_folder_never_mix(tmp_path):
    """Two `prisme train` processes started together into one folder: exactly one trains (exit 0), the other is
    refused (exit 2, naming the holder or the run), and every checkpoint and metrics row is the winner's."""
    out = tmp_path / "run"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**tiny_run(out, steps=6, log_every=1, ckpt_every=2).to_dict(), "model": "tiny"}))
    procs = [subprocess.Popen([sys.executable, "-m", "prisme", "train", "--config", str(cfg), "--seed", str(s),
                               "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    # the holder may not have written its pid yet when the loser reads the lock file: "in use by another process"
    assert "is in use by" in loser or "already holds a run" in loser
    winner_seed = (1, 2)[[rc for rc, _ in results].index(0)]
    assert ckpt.read_meta(out).stage_config["seed"] == winner_seed
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == list(range(1, 7))


# ---------------------------------------------------------------------- SIGTERM
def test_sigterm_saves_at_the_step_boundary_says_so_and_exits_143(tmp_path):
    """SIGTERM (what schedulers and `timeout` send) is handled as Ctrl-C: the step finishes, a checkpoint is saved,
    stderr says which signal and how to resume, the exit status is 143; --resume then finishes the run."""
    out = tmp_path / "run"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**tiny_run(out, steps=100000, log_every=1).to_dict(), "model": "tiny"}))
    p = subprocess.Popen([sys.executable, "-m", "prisme", "train", "--config", str(cfg), "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists()
                                          and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = p.stderr.read()
    assert rc == 143, err
    assert "SIGTERM" in err and "--resume" in err
    meta = ckpt.read_meta(out)
    assert meta.step >= 3 and (out / ckpt.checkpoint_name(meta.step)).is_dir()
    rc, _ = run_cli("train", "--resume", "--out", str(out), "--steps", str(meta.step + 2), "--reschedule")
    assert rc == 0 and ckpt.read_meta(out).step == meta.step + 2


# ---------------------------------------------------------------------- resume continues the saved run
def test_cli_resume_takes_the_runs_own_settings(tmp_path):
    """`prisme train --resume --out RUN` continues with the run's dataset, batch, sequence length and dtype (not the
    flags' defaults); `stage_config.json` keeps them; tokens in metrics.jsonl continue from the resumed count."""
    out = tmp_path / "run"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**tiny_run(out, steps=4, log_every=1, dtype="float64", batch_size=6).to_dict(),
                               "model": "tiny"}))
    assert run_cli("train", "--config", str(cfg), "--steps", "4")[0] == 0
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rc, _ = run_cli("train", "--resume", "--out", str(out), "--steps", "6", "--reschedule")
    assert rc == 0
    saved = json.loads((out / "stage_config.json").read_text())
    assert (saved["batch_size"], saved["seq_len"], saved["dtype"], saved["dataset"]) == (6, T, "float64", "mqar")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["tokens"] for r in train] == [6 * T * s for s in range(1, 7)]
    assert [r["loss"] for r in train[:4]] == [r["loss"] for r in first if r.get("split") == "train"]


@pytest.mark.parametrize("flag, value, field", [("--batch-size", "8", "batch_size"), ("--dtype", "float32", "dtype"),
                                                ("--seq-len", "8", "seq_len"), ("--dataset", "austen", "dataset")])
def test_resume_refuses_a_flag_that_would_change_the_run_naming_both_values(tmp_path, capsys, flag, value, field):
    """A resume flag that would change the run (another batch, dtype, sequence length or corpus) is refused with the
    run's value and the asked one named; nothing is written."""
    out = tmp_path / "run"
    train_stage(PrismeConfig.from_name("tiny"), tiny_run(out, steps=2, dtype="float64", batch_size=6))
    before = listing(out)
    rc, _ = run_cli("train", "--resume", "--out", str(out), "--steps", "2", flag, value)
    err = capsys.readouterr().err
    assert rc == 2 and field in err and "the run has" in err
    assert listing(out) == before


# ---------------------------------------------------------------------- checkpoints complete and readable
def test_a_config_json_missing_a_field_is_an_error_naming_it(tmp_path):
    """A checkpoint whose config.json lost a field (here `bank_source`) is a ValueError naming the field and the
    file, not a model rebuilt with the default; the fields added since schema 1 migrate by the explicit table."""
    path = ckpt.save_checkpoint(tmp_path / "ckpt_000001", __import__("prisme").PrismeModel(
        PrismeConfig.from_name("tiny", bank_source="embedding")), ckpt.TrainingState(stage="backbone", step=1))
    d = json.loads((path / "config.json").read_text())
    for added in ADDED_CONFIG_FIELDS:
        d.pop(added)
    (path / "config.json").write_text(json.dumps(d))
    assert ckpt.read_meta(path).config.bank_source == "embedding"  # migrated
    d.pop("bank_source")
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="config.json.*bank_source"):
        ckpt.read_meta(path)


def test_checkpoint_files_follow_the_umask(tmp_path):
    """model.safetensors and optimizer.pt get the same permissions as every other file (0644 under umask 022)."""
    old = os.umask(0o022)
    try:
        res = train_stage(PrismeConfig.from_name("tiny"), tiny_run(tmp_path / "run", steps=1))
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in res.checkpoint.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_an_optimizer_state_from_another_run_is_refused(tmp_path):
    """optimizer.pt carries a checksum in state.json: another run's file of the same shapes is refused by resume,
    naming the file."""
    a = train_stage(PrismeConfig.from_name("tiny"), tiny_run(tmp_path / "a", steps=2))
    b = train_stage(PrismeConfig.from_name("tiny"), tiny_run(tmp_path / "b", steps=2, seed=5))
    (a.checkpoint / ckpt.OPTIMIZER).write_bytes((b.checkpoint / ckpt.OPTIMIZER).read_bytes())
    with pytest.raises(ValueError, match="optimizer.pt"):
        train_stage(None, tiny_run(tmp_path / "a", steps=2, resume=True))


# ---------------------------------------------------------------------- untrained parts
def test_generate_refuses_a_workspace_no_stage_trained_and_eval_marks_it(tmp_path, capsys):
    """A backbone-stage checkpoint: `prisme generate --budget 2` is an error naming the untrained parts (a warning
    with --allow-untrained); `prisme eval` marks its workspace rows not deployable."""
    res = train_stage(PrismeConfig.from_name("tiny"), tiny_run(tmp_path / "run", steps=1))
    args = ["generate", "--checkpoint", str(res.checkpoint), "--prompt-ids", "1,2,3", "--max-new-tokens", "1"]
    rc, _ = run_cli(*args, "--budget", "2")
    assert rc == 2 and "workspace and controller" in capsys.readouterr().err
    rc, _ = run_cli(*args, "--budget", "2", "--allow-untrained")
    assert rc == 0 and "warning" in capsys.readouterr().err
    assert run_cli(*args, "--budget", "0")[0] == 0
    rc, out = run_cli("eval", "--checkpoint", str(res.checkpoint), "--batches", "1", "--batch-size", "4",
                      "--policies", "backbone,fixed,controller", "--lambdas", "0")
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith(("fixed", "controller"))]
    assert rows and all("untrained" in line for line in rows)
    assert ckpt.trained_groups(ckpt.read_meta(res.checkpoint)) == {"backbone"}


def test_an_interval_of_zeros_ties():
    """-0.0000 [-0.0000, -0.0000] (a policy that changed nothing, up to rounding) is "ties", not "beats"; a real
    interval below zero still beats."""
    assert verdict(-1e-15, -1e-16) == "ties"
    assert verdict(-2e-3, -1e-3) == "beats" and verdict(1e-3, 2e-3) == "loses"


# ---------------------------------------------------------------------- unclear before, clear now
def test_unclear_inputs_are_value_errors_naming_the_option(tmp_path, capsys):
    """--threads 0, a seed past 2**63, a temperature that overflows, stop_tokens=5, an output path that is a folder,
    map_location="cuda" without CUDA: each a one-line error naming what is wrong, before any long work."""
    from prisme.decoding.generate import generate
    from prisme.model.prisme import PrismeModel

    res = train_stage(PrismeConfig.from_name("tiny"), tiny_run(tmp_path / "run", steps=1))
    for argv, word in ((["train", "--stage", "backbone", "--preset", "tiny", "--threads", "0", "--out",
                         str(tmp_path / "t")], "--threads"),
                       (["generate", "--checkpoint", str(res.checkpoint), "--prompt-ids", "1", "--threads", "0"],
                        "--threads"),
                       (["generate", "--checkpoint", str(res.checkpoint), "--prompt-ids", "1", "--max-new-tokens", "2",
                         "--temperature",
                         "1e-300"], "temperature"),
                       (["eval", "--checkpoint", str(res.checkpoint), "--json", str(tmp_path)], "--json")):
        rc, _ = run_cli(*argv)
        assert rc == 2 and word in capsys.readouterr().err, argv
    assert not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="seed"):
        tiny_run(tmp_path / "s", seed=2**70).validate()
    model = PrismeModel(PrismeConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="stop_tokens"):
        generate(model, [[1, 2]], 2, stop_tokens=5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ckpt.load_checkpoint(res.checkpoint, map_location="cuda")
