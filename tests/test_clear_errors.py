"""Inputs that used to fail unclearly (a traceback, or a message naming neither the option nor the file) now give a
ValueError (or, for a failed write, an OSError) naming the problem, and leave files as they were. Each test has a
negative control: the well-formed neighbour of the bad input still works."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_run_safety import T, run_cli, tiny_run

from prisme import checkpoint as ckpt
from prisme import cli
from prisme.config import PrismeConfig
from prisme.data.tokenizers import BPETokenizer
from prisme.decoding.generate import generate
from prisme.interop import hf_available
from prisme.io import loads_config
from prisme.model.prisme import PrismeModel
from prisme.training.config import load_run_config
from prisme.training.distributed import DistInfo, check_memory, restore_optimizer
from prisme.training.resume import restore_rng_state
from prisme.training.trainer import train_stage

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife.\n") * 30


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step backbone run (MQAR, tiny preset)."""
    out = tmp_path_factory.mktemp("clear") / "run"
    train_stage(PrismeConfig.from_name("tiny"), tiny_run(out, steps=2))
    return out


def test_a_config_key_given_twice_is_refused_naming_the_key_and_file(tmp_path):
    """JSON keeps the last of two equal keys silently; a run config, a model config and a config string refuse it."""
    path = tmp_path / "run.json"
    path.write_text('{"stage": "backbone", "steps": 5, "steps": 50}')
    with pytest.raises(ValueError, match=r"run\.json.*'steps' appears twice"):
        load_run_config(path)
    with pytest.raises(ValueError, match="'d_model' appears twice"):
        PrismeConfig.from_json('{"d_model": 32, "d_model": 64}')
    path.write_text('{"stage": "backbone", "steps": 50}')  # control: each key once
    assert load_run_config(path)[1].steps == 50
    assert loads_config('{"a": {"b": 1}, "c": {"b": 2}}') == {"a": {"b": 1}, "c": {"b": 2}}  # same key, two objects


def test_a_negative_prompt_id_is_named_by_its_option(run, capsys):
    """`--prompt-ids -1,2` used to stop in argparse ("expected one argument"); now the id check names it."""
    args = ["generate", "--checkpoint", str(run), "--max-new-tokens", "1", "--prompt-ids"]
    rc, _ = run_cli(*args, "-1,2")
    assert rc == 2 and "--prompt-ids: id -1" in capsys.readouterr().err
    rc, out = run_cli(*args, "1,2")  # control
    assert rc == 0 and out.startswith("1,2 ")
    assert cli.attach_negative_values(["--prompt-ids", "-1,2", "--seed", "-3"]) == ["--prompt-ids=-1,2", "--seed",
                                                                                   "-3"]


def test_a_tokenizer_folder_loads_its_tokenizer_json_or_says_it_has_none(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match="folder with no tokenizer.json"):
        BPETokenizer.load(tmp_path)
    tok = BPETokenizer.train(TEXT, 280)
    tok.save(tmp_path / "tokenizer.json")
    assert BPETokenizer.load(tmp_path).encode("a truth") == tok.encode("a truth")  # control: the folder loads


def test_a_vocab_size_the_text_cannot_reach_is_refused():
    """`tokenizer train --vocab-size 300` on a tiny text used to return 256 ids silently."""
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match="vocab_size=300.*yields at most 261 tokens"):  # 11 bytes: 5 merges at most
        BPETokenizer.train("hello world", 300)
    with pytest.raises(ValueError, match="vocab_size=270.*yields only 266 tokens"):  # reachable, not reached
        BPETokenizer.train("hello world, hello world, hello world", 270)
    assert BPETokenizer.train(TEXT, 280).vocab_size == 280  # control: a reachable size is met exactly


def test_export_hf_without_transformers_names_the_extra(run, tmp_path, capsys, monkeypatch):
    import prisme.interop as interop

    monkeypatch.setattr(interop, "hf_available", lambda: False)
    rc, _ = run_cli("export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf"))
    assert rc == 2 and "pip install 'prisme[hf]'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    if not hf_available():  # the library call says the same (an ImportError with the extra to install)
        with pytest.raises(ImportError, match=r"prisme\[hf\]"):
            interop.export_hf(ckpt.load_model(run)[0], tmp_path / "hf2")


def test_a_full_disk_during_a_save_names_the_checkpoint_and_keeps_the_previous(tmp_path, monkeypatch):
    """ENOSPC while writing ckpt_2: an OSError naming it and the intact ckpt_1; no temporary folder is left and
    `latest` still names ckpt_1."""
    model = PrismeModel(PrismeConfig.from_name("tiny"))
    first = ckpt.save_checkpoint(tmp_path / "ckpt_000001", model, ckpt.TrainingState(stage="backbone", step=1))
    real = ckpt.write_file

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_file", full)
    with pytest.raises(OSError, match=r"ckpt_000002 \(No space left on device\); the previous checkpoint "
                                      r".*ckpt_000001 is intact") as e:
        ckpt.save_checkpoint(tmp_path / "ckpt_000002", model, ckpt.TrainingState(stage="backbone", step=2))
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000001", ckpt.LATEST]
    assert ckpt.read_meta(tmp_path).path == first
    monkeypatch.setattr(ckpt, "write_file", real)  # control: the same save succeeds with space
    ckpt.save_checkpoint(tmp_path / "ckpt_000002", model, ckpt.TrainingState(stage="backbone", step=2))
    assert ckpt.read_meta(tmp_path).step == 2


def test_a_missing_weights_file_is_named(run, tmp_path):
    """A run whose checkpoint lost model.safetensors: the error names that file (it used to say "no state.json, no
    latest pointer")."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (ckpt.resolve_checkpoint(copy) / ckpt.WEIGHTS).unlink()
    with pytest.raises(ValueError, match=r"is missing .*model\.safetensors"):
        ckpt.find_model_checkpoint(copy)
    assert ckpt.find_model_checkpoint(run) == ckpt.resolve_checkpoint(run)  # control


def test_a_corrupt_rng_state_names_the_state_file(run, tmp_path):
    gens = {"data": torch.Generator(), "sample": torch.Generator()}
    good = ckpt.read_meta(run).rng
    restore_rng_state(gens, good, "state.json")  # control: the saved state restores
    with pytest.raises(ValueError, match=r"somewhere/state\.json: its `rng` entry is corrupt"):
        restore_rng_state(gens, {**good, "data": "not base64!"}, Path("somewhere/state.json"))
    with pytest.raises(ValueError, match=r"somewhere/state\.json: its `rng` entry is corrupt"):
        restore_rng_state(gens, {**good, "data": "AAAA"}, Path("somewhere/state.json"))  # decodes, wrong length


def test_an_optimizer_state_of_other_shapes_names_the_file():
    a = torch.nn.Linear(3, 2)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1)) for _ in range(3)])  # 3 parameters, not 2
    opt = torch.optim.AdamW(a.parameters())
    saved = {"format": "torch", "state": other.state_dict()}
    with pytest.raises(ValueError, match=r"run/ckpt_000002/optimizer\.pt does not fit this run's optimizer"):
        restore_optimizer(a, opt, saved, tiny_run(Path("x")), DistInfo(), Path("run/ckpt_000002/optimizer.pt"))
    restore_optimizer(a, opt, {"format": "torch", "state": opt.state_dict()}, tiny_run(Path("x")), DistInfo())


def test_numpy_prompts_generate_what_lists_generate():
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    want = generate(model, [[1, 2, 3]], 3).tokens
    assert generate(model, np.array([[1, 2, 3]]), 3).tokens == want
    assert generate(model, [np.array([1, 2, 3], dtype=np.int32)], 3).tokens == want
    assert generate(model, [[np.int64(1), 2, np.int16(3)]], 3).tokens == want
    with pytest.raises(ValueError, match="integer token ids"):
        generate(model, np.array([[1.0, 2.0]]), 3)


def test_forward_with_actions_that_are_not_a_tensor_is_a_value_error():
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    x = torch.randint(0, 64, (1, 8))
    with pytest.raises(ValueError, match="actions must be a .* tensor.* got list"):
        model(x, actions=[[[0]] * 8])
    assert model(x, actions=torch.zeros(1, 8, 1, dtype=torch.long)).logits.shape == (1, 8, 64)  # control


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_anything_is_written(tmp_path):
    """`--batch-size 100000000` used to die in the allocator (or swap for minutes); now a ValueError naming the
    option, before the run folder exists."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"batch_size=100000000 .*GiB.*lower --batch-size or raise --grad-accum"):
        train_stage(PrismeConfig.from_name("tiny"), tiny_run(out, batch_size=10**8))
    assert not out.exists()
    cfg = PrismeConfig.from_name("tiny")
    check_memory(tiny_run(out), cfg, T, DistInfo(), torch.device("cpu"))  # control: 4 x 16 fits
    # the bound divides by grad_accum x world: the same global batch in 10**4 micro-batches fits
    check_memory(tiny_run(out, batch_size=10**8, grad_accum=10**4), cfg, T, DistInfo(), torch.device("cpu"))


def test_the_duplicate_key_check_reads_what_save_writes(tmp_path):
    """Every config PRISME writes reads back through the strict loader (no key written twice)."""
    cfg = PrismeConfig.from_name("tiny")
    assert PrismeConfig.from_json(cfg.to_json()) == cfg
    assert loads_config(json.dumps(tiny_run(tmp_path).to_dict()))["steps"] == 3


def test_a_prompt_that_is_not_utf8_names_the_option_and_the_byte(capsys):
    """A non-UTF-8 command-line prompt reaches Python as surrogate escapes; encoding them used to fail with
    "surrogates not allowed"."""
    from prisme.checks import check_utf8

    rc, _ = run_cli("generate", "--preset", "demo", "--prompt", "ab\udcffc", "--max-new-tokens", "1")
    assert rc == 2 and "--prompt is not valid UTF-8 text (byte 0xff at character 2)" in capsys.readouterr().err
    assert check_utf8("naïve 日本", "--prompt") == "naïve 日本"  # control: real Unicode passes
