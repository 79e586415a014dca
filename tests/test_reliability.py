"""Bad input gets a clear error naming the problem (and the file), nothing is silently wrong, and everyday commands do
what a user expects (docs/reliability.md lists every case with its command). In-process: `cli.main`, not a
subprocess per case."""

from __future__ import annotations

import io
import json
import math
import os
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from prisme import checkpoint as ckpt
from prisme import cli
from prisme.config import PrismeConfig
from prisme.decoding.sampling import sample_logits
from prisme.model.prisme import PrismeModel
from prisme.training.config import StageConfig, load_run_config
from prisme.training.trainer import NonFiniteLossError, train_stage

T = 16


def run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(list(argv))
    return rc, buf.getvalue()


def tiny_run(tmp_path: Path, steps: int = 3, **kw) -> StageConfig:
    return StageConfig(stage="backbone", steps=steps, batch_size=4, seq_len=T, out_dir=str(tmp_path / "run"),
                       dataset="mqar", mqar=dict(vocab_size=64, seq_len=T, n_pairs=2, query_min_pos=4),
                       progress=False, eval_every=0, eval_batches=1, **kw)


# ---------------------------------------------------------------------- silently wrong, now errors
@pytest.mark.parametrize("kw", [dict(lambda_cost=float("nan")), dict(kappa_risk=float("inf")),
                                dict(lambda_cost=-1.0)])
def test_forward_policy_rejects_non_finite_or_negative_prices(kw):
    """NaN / inf prices made every action STOP (a quiet backbone-only output); now a ValueError naming the price."""
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    with pytest.raises(ValueError, match=next(iter(kw))):
        model.forward_policy(torch.zeros(1, 4, dtype=torch.long), 2, **kw)


@pytest.mark.parametrize("kw, field", [(dict(optimised="no"), "optimised"), (dict(init_std=float("inf")), "init_std"),
                                       (dict(rope_theta="x"), "rope_theta"), (dict(gate_bias_init="a"),
                                                                              "gate_bias_init"),
                                       (dict(z_norm=1), "z_norm"), (dict(norm_eps=float("nan")), "norm_eps")])
def test_every_config_field_is_type_checked(kw, field):
    """Bools are bools, floats finite, strings strings: a ValueError naming the field, before any module exists."""
    with pytest.raises(ValueError, match=field):
        PrismeConfig.from_name("tiny", **kw)


@pytest.mark.parametrize("kw, msg", [(dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")),
                                                                               "temperature"),
                                     (dict(temperature=1.0, top_k=0), "top_k"), (dict(temperature=1.0, top_p=0.0),
                                                                                 "top_p"),
                                     (dict(temperature=1.0, top_p=1.5), "top_p")])
def test_sample_logits_rejects_bad_sampling_settings(kw, msg):
    """A negative temperature sampled the inverted distribution; top_k=0, top_p=0 and NaN raised torch errors."""
    with pytest.raises(ValueError, match=msg):
        sample_logits(torch.randn(2, 8), **kw)
    assert sample_logits(torch.tensor([[0.0, 5.0]]), temperature=1.0, top_k=1).tolist() == [1]


def test_eval_rejects_a_matched_backbone_of_another_architecture(tmp_path, capsys):
    """`prisme eval --matched-backbone` of another size printed a 'matched' row 2.5 nats worse; now exit 2 naming the
    differing fields."""
    a = ckpt.save_checkpoint(tmp_path / "a" / "ckpt_000000", PrismeModel(PrismeConfig.from_name("tiny")),
                             ckpt.TrainingState("backbone", 0, stage_config=StageConfig(dataset="mqar").to_dict()))
    b = ckpt.save_checkpoint(tmp_path / "b" / "ckpt_000000",
                             PrismeModel(PrismeConfig.from_name("tiny", d_model=64, n_head=4)),
                             ckpt.TrainingState("backbone", 0))
    rc, _ = run_cli("eval", "--checkpoint", str(a), "--matched-backbone", str(b), "--policies", "backbone,matched")
    err = capsys.readouterr().err
    assert rc == 2 and "d_model" in err and "another backbone" in err


# ---------------------------------------------------------------------- unclear, now clear
@pytest.mark.parametrize("field, value", [("lr", "0.01"), ("eps", "x"), ("progress", 1), ("steps", 2.5)])
def test_run_config_field_types_are_checked_naming_the_field(tmp_path, field, value):
    """A string lr, a non-number eps, an int for a bool: ValueError naming the field (not a TypeError traceback)."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"stage": "backbone", field: value}))
    with pytest.raises(ValueError, match=field):
        load_run_config(path)


def test_non_utf8_config_latest_and_a_bad_state_step_name_the_file(tmp_path):
    """Non-UTF-8 bytes in a config, in `latest`, or a non-integer step in state.json: ValueError naming the file."""
    bad = tmp_path / "c.json"
    bad.write_bytes(b'{"stage": "\xff"}')
    with pytest.raises(ValueError, match="c.json"):
        load_run_config(bad)
    with pytest.raises(ValueError, match="c.json"):
        PrismeConfig.from_json(bad)
    run = tmp_path / "run"
    path = ckpt.save_checkpoint(run / "ckpt_000001", PrismeModel(PrismeConfig.from_name("tiny")),
                                ckpt.TrainingState(stage="backbone", step=1))
    (run / "latest").write_bytes(b"\xfe\xff")
    with pytest.raises(ValueError, match="latest"):
        ckpt.load_model(run)
    state = json.loads((path / "state.json").read_text())
    state["step"] = "abc"
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="state.json"):
        ckpt.read_meta(path)


def test_a_torn_last_metrics_line_is_dropped_on_resume_and_stale_temps_are_cleaned(tmp_path, capsys):
    """A kill mid-append leaves half a JSON line: --resume drops it (saying so) and goes on; folders and files left
    by killed saves are removed at the next resume."""
    scfg = tiny_run(tmp_path, steps=2, ckpt_every=1, log_every=1)
    train_stage(PrismeConfig.from_name("tiny"), scfg)
    run = Path(scfg.out_dir)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tr')  # torn
    (run / ".ckpt_000003.tmp-abc").mkdir()
    (run / ".latest.x1.tmp").write_text("half")
    res = train_stage(None, scfg.replace(resume=True, steps=2))
    assert res.step == 2 and "torn last line" in capsys.readouterr().err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    assert not (run / ".ckpt_000003.tmp-abc").exists() and not (run / ".latest.x1.tmp").exists()


def test_resume_with_another_steps_refuses_unless_rescheduled(tmp_path):
    """--resume with another --steps silently changed the lr schedule; now a ValueError naming both step counts,
    unless reschedule=True; fewer steps than already done is an error either way."""
    scfg = tiny_run(tmp_path, steps=2)
    train_stage(PrismeConfig.from_name("tiny"), scfg)
    with pytest.raises(ValueError, match="steps=4.*steps=2"):
        train_stage(None, scfg.replace(resume=True, steps=4))
    assert train_stage(None, scfg.replace(resume=True, steps=4, reschedule=True)).step == 4
    with pytest.raises(ValueError, match="already at step 4"):
        train_stage(None, scfg.replace(resume=True, steps=3, reschedule=True))


def test_a_non_finite_loss_before_any_checkpoint_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    """NaN at the first step: stderr says nothing was saved (not 'resume with --resume'), exit status 1."""
    import prisme.training.objectives as objectives

    monkeypatch.setattr(objectives.BackboneObjective, "forward",
                        lambda self, x, y, e, d: (torch.tensor(float("nan"), requires_grad=True), {}))
    with pytest.raises(NonFiniteLossError, match="nothing was saved"):
        train_stage(PrismeConfig.from_name("tiny"), tiny_run(tmp_path))
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps({**tiny_run(tmp_path / "b").to_dict(), "model": "tiny"}))
    rc, out = run_cli("train", "--config", str(cfg_path))
    err = capsys.readouterr().err
    assert rc == 1 and "nothing was saved" in err and "--resume" not in err and "non-finite" not in out


def test_ctrl_c_exits_130_without_a_traceback_and_a_closed_pipe_exits_quietly(monkeypatch, capsys):
    """KeyboardInterrupt anywhere in a command: exit 130 and one line; BrokenPipeError: exit 0, nothing printed."""
    def interrupt(args):
        raise KeyboardInterrupt

    def broken(args):
        raise BrokenPipeError

    monkeypatch.setattr(cli, "_cmd_info", interrupt)
    assert cli.main(["info"]) == 130 and capsys.readouterr().err.strip() == "prisme: interrupted"
    monkeypatch.setattr(cli, "_cmd_info", broken)
    assert cli.main(["info"]) == 0 and capsys.readouterr().err == ""


def test_unexpected_errors_go_through_the_one_handler(monkeypatch, capsys):
    """Any other exception prints `prisme: error: <type>: ...` and exits 2 (PRISME_DEBUG=1 re-raises it)."""
    def boom(args):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(cli, "_cmd_info", boom)
    assert cli.main(["info"]) == 2 and "prisme: error: RuntimeError: kaboom" in capsys.readouterr().err
    monkeypatch.setenv("PRISME_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main(["info"])


def test_generate_device_vocab_and_tokenizer_errors_are_clear(tmp_path, capsys):
    """generate --device cuda without CUDA, the byte tokenizer on a 64-id model, a tokenizer path that is not a
    tokenizer: each one line naming the problem, exit 2."""
    cases = [(["--preset", "tiny", "--prompt", "ab"], "byte tokenizer has 256 ids"),
             (["--preset", "demo", "--prompt", "ab", "--tokenizer", str(tmp_path / "none.json")], "does not exist")]
    if not torch.cuda.is_available():
        cases.append((["--preset", "demo", "--prompt", "ab", "--device", "cuda"], "CUDA is not available"))
    junk = tmp_path / "junk.json"
    junk.write_bytes(os.urandom(64))
    cases.append((["--preset", "demo", "--prompt", "ab", "--tokenizer", str(junk)], "not a tokenizer file"))
    for argv, msg in cases:
        rc, _ = run_cli("generate", *argv, "--max-new-tokens", "1")
        err = capsys.readouterr().err
        assert rc == 2 and msg in err, (argv, err)
    if not torch.cuda.is_available():
        rc, _ = run_cli("eval", "--checkpoint", str(tmp_path), "--device", "cuda")
        assert rc == 2 and "CUDA is not available" in capsys.readouterr().err


# ---------------------------------------------------------------------- ordinary use
def test_generate_and_eval_accept_a_run_folder_of_several_stages(tmp_path, capsys):
    """`--checkpoint` a folder holding stage runs (a demo / study folder) uses its most trained stage."""
    model = PrismeModel(PrismeConfig.from_name("tiny", vocab_size=256))
    for i, stage in enumerate(("backbone", "workspace", "controller")):
        ckpt.save_checkpoint(tmp_path / "demo" / f"{i + 1}_{stage}" / "ckpt_000001", model,
                             ckpt.TrainingState(stage=stage, step=1))
    assert ckpt.find_model_checkpoint(tmp_path / "demo").parent.name == "3_controller"
    rc, out = run_cli("generate", "--checkpoint", str(tmp_path / "demo"), "--prompt", "Emma", "--max-new-tokens",
                      "2", "--budget", "1", "--show-edits")
    assert rc == 0 and "3_controller" in capsys.readouterr().err
    assert "legend:" in out and "steps = controller evaluations" in out
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no checkpoint"):
        ckpt.find_model_checkpoint(tmp_path / "empty")


def test_tokenizer_train_command_and_its_missing_extra(tmp_path, monkeypatch, capsys):
    """`prisme tokenizer train` writes a BPE the other commands load; without `tokenizers` it names the extra."""
    pytest.importorskip("tokenizers")
    out = tmp_path / "bpe.json"
    rc, text = run_cli("tokenizer", "train", "--corpus", "devils_dictionary", "--vocab-size", "300", "--out",
                       str(out))
    assert rc == 0 and out.is_file()
    from prisme.data.tokenizers import BPETokenizer

    tok = BPETokenizer.load(out)
    assert tok.vocab_size == 300 and tok.decode(tok.encode("Ambrose — Bierce")) == "Ambrose — Bierce"
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "tokenizers" else real(name, *a, **k))
    rc, _ = run_cli("tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path / "x.json"))
    assert rc == 2 and "prisme[bpe]" in capsys.readouterr().err


def test_the_exported_byte_tokenizer_round_trips_any_text():
    """The byte tokenizer in HF `tokenizers` form: ids are the UTF-8 bytes (non-ASCII, NUL and U+0100 included)."""
    pytest.importorskip("tokenizers")
    from prisme.interop import byte_tokenizer_hf

    tok = byte_tokenizer_hf()
    for text in ("héllo – ü 日本", "Ā and \x00", "plain ascii", ""):
        ids = tok.encode(text).ids
        assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.get_vocab_size() == 256


def test_export_hf_folder_loads_with_autotokenizer(tmp_path):
    """`prisme export-hf` writes a folder that AutoModelForCausalLM and AutoTokenizer load on their own; the byte
    tokenizer round-trips non-ASCII text and NUL is the bos/eos/pad id."""
    transformers = pytest.importorskip("transformers")
    model = PrismeModel(PrismeConfig.from_name("tiny", vocab_size=256))
    c = ckpt.save_checkpoint(tmp_path / "r" / "ckpt_000000", model, ckpt.TrainingState(stage="backbone", step=0))
    rc, _ = run_cli("export-hf", "--checkpoint", str(c), "--out", str(tmp_path / "hf"))
    assert rc == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "héllo – ü 日本"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.eos_token_id == hf.config.pad_token_id == 0
    x = torch.tensor([list(text.encode("utf-8"))])
    with torch.no_grad():
        assert math.isclose(float((hf(x).logits - model(x).logits).abs().max()), 0.0, abs_tol=1e-4)
