"""Every option, input file and output path is checked before the work, and the error names what to change: a
benchmark gives no verdict on rows it did not measure, a study refuses bad settings before anything trains (and
re-scores finished runs with `--reuse`), a study folder of other settings is refused naming the folder's kind and the
fields that differ, options that would do nothing are errors, and OS errors name the path (docs/reliability.md,
"Checked before the work").
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from prisme import cli


def boom(*args, **kwargs):
    raise RuntimeError("the work started")


def error_of(capsys) -> str:
    return capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------ lists
def test_one_list_parser_refuses_empty_lists_and_entries_naming_the_option():
    """`parse_list` reads every comma-separated option: an empty list, an empty entry, a bad entry and a repeat are
    ValueErrors naming the option; a good list reads back entry by entry."""
    from prisme.checks import integer, number, one_of, parse_list

    assert parse_list(" 1, 8", "--batches", integer(1)) == [1, 8]
    assert parse_list("0,0.5", "--lambdas", number(0)) == [0.0, 0.5]
    for text, reader, want in (("", str, "--x is empty"), (" , ", str, "--x is empty"),
                               ("1,", integer(1), "empty entry"), ("1,,2", integer(1), "empty entry"),
                               ("1,x", integer(1), "'x' is not an integer"),
                               ("0", integer(1), "'0' is not an integer >= 1"), ("nan", number(0), "finite"),
                               ("a,c", one_of(["a", "b"]), "'c' is not one of a, b")):
        with pytest.raises(ValueError, match=f"--x.*{want}" if "--x" not in want else want):
            parse_list(text, "--x", reader)
    with pytest.raises(ValueError, match="lists a twice"):
        parse_list("a,b,a", "--x", distinct=True)


@pytest.mark.parametrize("argv, want", [(["generate", "--preset", "tiny", "--prompt-ids", "5,,9"], "empty entry"),
                                        (["demo", "--sources", ""], "--sources is empty"),
                                        (["demo", "--recall-seeds", ""], "--recall-seeds is empty"),
                                        (["study", "recall", "--seeds", "0,"], "--seeds '0,' has an empty entry")])
def test_every_list_option_goes_through_the_one_parser(argv, want, capsys, monkeypatch):
    """The lists of `generate`, `demo` and `study recall` are read like every other (`--prompt-ids 5,,9` was the
    prompt 5,9; `demo --sources ""` ran the default source, `--recall-seeds ""` skipped the recall run)."""
    import prisme.studies.demo as demo
    import prisme.studies.recall as recall

    monkeypatch.setattr(demo, "run_demo", boom)
    monkeypatch.setattr(recall, "run_study", boom)
    assert cli.main(argv) == 2
    err = error_of(capsys)
    assert want in err and "the work started" not in err


# ------------------------------------------------------------------------------------------------------- benchmarks
@pytest.mark.parametrize("argv, want", [(["--shapes", ""], "--shapes is empty"), (["--shapes", "tiny,"], "empty entry"),
                                        (["--shapes", "tiny,tiny"], "lists tiny twice"),
                                        (["--batches", ""], "--batches is empty"),
                                        (["--shapes", "tiny", "--json", "."], "--json . is a folder")])
def test_bench_decode_gives_no_verdict_on_rows_it_did_not_measure(argv, want, capsys, monkeypatch):
    """`bench decode --shapes ""` exited 0 with no rows and `checks.passed: true`, and `--json .` failed after the
    whole benchmark: each is an error naming the option before anything is timed."""
    import prisme.bench.decode as decode

    monkeypatch.setattr(decode, "measure", boom)
    assert cli.main(["bench", "decode", *argv]) == 2
    err = error_of(capsys)
    assert want in err and "the work started" not in err


@pytest.mark.parametrize("argv", [["decode", "--repeats", "0"], ["decode", "--repeats", "-1"],
                                  ["decode", "--new-tokens", "0"], ["kv", "--repeats", "0"],
                                  ["workspace", "--quick", "--warmups", "-1"], ["train", "--repeats", "0"],
                                  ["vs-hf", "--shapes", "seed001", "--repeats", "0"]])
def test_bench_counts_are_checked_where_they_are_parsed(argv, capsys, monkeypatch):
    """`--repeats 0` / `-1` timed nothing and wrote NaN with `checks.passed: true`; `--new-tokens 0` blamed
    `--prompt-len 8`: every benchmark's counts are argparse's error naming the option (exit 2), before any work."""
    import prisme.bench.decode as decode

    monkeypatch.setattr(decode, "measure", boom)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    err = error_of(capsys).strip().splitlines()[-1]  # argparse's usage lines, then its one error line
    assert e.value.code == 2 and f"argument {argv[-2]}: must be an integer >= " in err and "--prompt-len" not in err


def test_bench_decode_records_the_new_tokens_it_ran_with_a_note(tmp_path, capsys):
    """`--new-tokens 100000` was cut to what the shape holds while the JSON said 100000: a note on stderr, and the
    JSON records what ran per shape beside what was asked; the verdict counts the rows it measured."""
    out = tmp_path / "decode.json"
    assert cli.main(["bench", "decode", "--shapes", "tiny", "--batches", "1", "--repeats", "1", "--new-tokens",
                     "100000", "--json", str(out)]) in (0, 1)
    assert "note: tiny: --new-tokens 100000 is more than its T_max = 64 leaves" in error_of(capsys)
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert doc["settings"]["new_tokens"] == {"tiny": 56} and doc["settings"]["new_tokens_asked"] == 100000
    assert doc["checks"]["rows_measured"] == 1 and doc["checks"]["passed"]


def test_a_benchmark_document_is_strict_json_and_a_nan_fails_its_checks(capsys):
    """`emit` wrote NaN (a JSON strict parsers reject) under `passed: true`: a non-finite number is written as null
    and fails the checks (exit 1). Negative control: a finite document passes as before."""
    from prisme.bench.harness import emit

    assert emit({"rows": [{"ms": float("nan")}], "checks": {"passed": True}}, "table") == 1
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{"):], parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert doc["rows"] == [{"ms": None}] and doc["checks"] == {"passed": False, "finite": False}
    assert emit({"rows": [{"ms": 1.5}], "checks": {"passed": True}}, "table") == 0


# ------------------------------------------------------------------------------------------------------- text study
@pytest.mark.parametrize("argv, want", [
    (["--context", "512", "--held-out", "HELD"], "--held-out HELD holds 10 bytes, fewer than one evaluation window "
                                                 "of 512 bytes + 1 target: pass a longer text, or a shorter --context"),
    (["--held-out", "HELD"], "or a shorter --window"),
    (["--context", "2"], "--context 2 is too short for PRISME's model: 65 bytes at least"),
    (["--context", "100000"], "--context 100000 is longer than 4,096"),
    (["--sources", ""], "--sources is empty"), (["--sources", "residual,residual"], "lists residual twice"),
    (["--sources", "resid"], "'resid' is not one of"), (["--frontier", ""], "--frontier is empty"),
    (["--val-batches", "abc"], "--val-batches must be a number of batches >= 1, or all; got 'abc'"),
    (["--val-batches", "0"], "--val-batches"), (["--val-batches", "100000"], "more than the validation split holds"),
    (["--seed", "3"], "--seeds 1 and --seed 3 both set the training seeds"),
    (["--held-out", ""], "--held-out is empty"),
    (["--ngram", "0"], "(--ngram) must be an int >= 1"), (["--ngram", "200"], "pass --ngram 127 or less"),
    (["--threads", "0"], "threads (--threads) must be an int >= 1"), (["--json", "."], "--json . is a folder")])
def test_the_text_study_checks_every_option_and_input_before_anything_trains(argv, want, tmp_path, capsys,
                                                                               monkeypatch):
    """`study text` trained every run before finding a held-out text shorter than one window (and advised
    `--seq-len`, an option it has not), crashed inside the router at `--context 2`, started training at `--context
    100000`, ran the defaults for `--sources ""` / `--frontier ""`, and said `invalid literal for int()` for
    `--val-batches abc`: each is now an error naming the option, before anything trains or is written."""
    import prisme.studies.text as text

    monkeypatch.setattr(text, "run_tasks", boom)
    held = tmp_path / "held.txt"
    held.write_text("short text")
    argv = [str(held) if a == "HELD" else a for a in argv]
    out = tmp_path / "study"
    assert cli.main(["study", "text", "--seeds", "1", "--scale", "0.01", "--out", str(out), *argv]) == 2
    err = error_of(capsys).replace(str(held), "HELD")
    assert want in err and "the work started" not in err and "--seq-len" not in err and "Error:" not in err
    assert not out.exists()


def test_the_text_study_rescores_finished_runs_with_reuse(tmp_path, capsys, monkeypatch):
    """`--reuse FOLDER` (as the recall study has): another held-out text and other scoring settings re-score the
    finished runs of FOLDER without training them again; each copied run is listed (`reused`). Negative controls: a
    frontier model FOLDER never trained is not copied (it trains), and a folder of another kind of study is
    refused."""
    import prisme.training.trainer as trainer
    from prisme.config import PrismeConfig
    from prisme.studies import text
    from prisme.studies.cli import text_config
    from prisme.studies.records import open_study, record_study

    model = PrismeConfig.from_name("tiny", vocab_size=256)
    held = tmp_path / "held.txt"
    held.write_text("Abasement, n. A decent and customary mental attitude in the presence of wealth. " * 6)
    cfg = text.TextStudyConfig(sources=["residual"], seeds=[3], frontier=[[1, 16]], scale=0.01, val_batches=1,
                               held_out=str(held), jobs=1, progress=False, bootstrap_samples=20, eval_batch_size=8,
                               out_dir=str(tmp_path / "a"))
    first = text.run_study(cfg, model)
    other = tmp_path / "other.txt"
    other.write_text("Bore, n. A person who talks when you wish him to listen. " * 20)
    monkeypatch.setattr(trainer, "train_stage", boom)
    again = text.TextStudyConfig(**{**cfg.__dict__, "held_out": str(other), "val_batches": 2, "reuse": cfg.out_dir,
                                    "out_dir": str(tmp_path / "b")})
    doc = text.run_study(again, model)  # trains nothing
    assert "--reuse: 4 runs copied" in error_of(capsys)
    assert sorted(Path(k).relative_to(tmp_path / "b").as_posix() for k in doc["reused"]) == [
        "seed3/1_backbone", "seed3/3_backbone_matched", "seed3/frontier/L1_d16", "seed3/residual"]
    new, old = (d["seeds"]["3"]["sources"]["residual"]["held_out"] for d in (doc, first))
    assert new["n_tokens"] > old["n_tokens"]  # scored on the other text
    wider = text.TextStudyConfig(**{**again.__dict__, "frontier": [[1, 16], [1, 24]], "out_dir": str(tmp_path / "c")})
    model_cfg, stages, tasks = text.prepare_study(wider, model)
    settings = text.study_settings(wider, model_cfg, stages)
    assert not open_study(wider.out_dir, settings)
    copied = text.reuse_training(wider, settings, tasks)
    assert sorted(Path(p).relative_to(tmp_path / "c").as_posix() for p in copied) == [
        "seed3/1_backbone", "seed3/3_backbone_matched", "seed3/frontier/L1_d16", "seed3/residual"]  # not L1_d24
    args = cli.build_parser().parse_args(["study", "text", "--reuse", cfg.out_dir, "--out", str(tmp_path / "d")])
    assert text_config(args).reuse == cfg.out_dir
    record_study(tmp_path / "recall", {"kind": "frontier", "quick": True, "study": {}, "runs": {}})
    with pytest.raises(ValueError, match="--reuse: .*recall holds a recall study .*not a text study"):
        text.run_study(text.TextStudyConfig(**{**again.__dict__, "reuse": str(tmp_path / "recall"),
                                               "out_dir": str(tmp_path / "e")}), model)


# --------------------------------------------------------------------------------------------- the settings guard
def recall_record(contexts: list[int], steps: int = 12) -> dict:
    return {"kind": "frontier", "quick": True, "study": {"seeds": [0], "contexts": contexts, "frontier": True},
            "steps": {"seed0": {"backbone": steps}},
            "runs": {"seed0": {"model": {"w": 16}, "stages": [{"steps": steps, "out_dir": "x"}]}}}


def test_the_settings_guard_names_the_folders_kind_and_the_fields_that_differ(tmp_path):
    """A folder of another study was refused as "a text study run with other settings" (the command's kind, not the
    folder's) with a dump of cut-off settings, and `--context 512,256` differed from `256,512`: now the folder's kind
    and the options that made it are named, each differing field by its path (the study's own first, the derived
    ones only when nothing else differs), and lists of lengths compare as sets."""
    from prisme.studies.runner import open_study, record_study

    out = tmp_path / "s"
    record_study(out, recall_record([512, 256]))  # its kind: from its settings
    with pytest.raises(ValueError, match=r"holds a recall study \(--frontier --context 256,512 --quick\) \(made by "
                                         r"`prisme study recall`\), not a text study: pass another --out"):
        open_study(out, {"study": {}, "model": {}, "stages": {}}, label="text study")
    assert open_study(out, recall_record([256, 512]), label="recall study")  # the same lengths, another order
    with pytest.raises(ValueError) as e:
        open_study(out, {**recall_record([256, 512], steps=300), "study": {"seeds": [0, 1], "contexts": [256, 512],
                                                                           "frontier": True}}, label="recall study")
    assert "(study.seeds: was [0], now [0, 1])" in str(e.value)  # the option, not the runs it derives
    with pytest.raises(ValueError) as e:
        open_study(out, recall_record([256, 512], steps=300), label="recall study")
    assert "runs.seed0.stages[0].steps: was 12, now 300" in str(e.value)  # nothing else differs: the derived fields
    assert "steps.seed0.backbone: was 12, now 300" in str(e.value)
    from prisme.studies.cli import recall_args

    args = cli.build_parser().parse_args(["study", "recall", "--frontier", "--context", "1024, 256,512"])
    assert recall_args(args).context == "256,512,1024"
    for bad in ("", "256,", "256,256", "x"):
        with pytest.raises(ValueError, match="--context"):
            recall_args(cli.build_parser().parse_args(["study", "recall", "--frontier", f"--context={bad}"]))


# --------------------------------------------------------------------------------------------------- recall advice
def recall_configs(tmp_path: Path, **study) -> str:
    from prisme.io import CONFIG_DIR

    folder = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, folder)
    path = folder / "recall_study.json"
    path.write_text(json.dumps(study.pop("raw")) if "raw" in study else
                    json.dumps({**json.loads(path.read_text()), **study}))
    return str(folder)


@pytest.mark.parametrize("study, contexts, want", [
    (dict(context_queries=50), [256], r"context_queries = 50 \(in .*recall_study.json\) is more than the task's "
                                      r"n_pairs = 4 .*set context_queries to at most 4"),
    (dict(context_family=[{"d": 8, "w": 32, "attn_window": 5000, "key_shift": True}]), [256],
     "the largest attention window, 5000 .*T_max = 4,096 .*lower that attn_window to at most 4,080"),
    ({}, [60], "--context 60 cannot hold 4 queries .*pass lengths of at least 80")])
def test_recall_advice_names_what_can_fix_it(study, contexts, want, tmp_path):
    """"pass longer contexts" could fix neither 50 queries of 4 pairs nor a 5,000-position window under T_max =
    4,096: the error names the study file's field and the value that fits; a length too short names --context."""
    from prisme.studies.recall import prepare_study
    from prisme.studies.recall_setup import study_config

    cfg = study_config({"frontier": True, "contexts": contexts, "out_dir": str(tmp_path / "out")},
                       recall_configs(tmp_path, **study))
    with pytest.raises(ValueError, match=want) as e:
        prepare_study(cfg)
    assert "pass longer contexts" not in str(e.value)


def test_a_recall_study_file_holding_a_list_must_be_an_object(tmp_path):
    """A `recall_study.json` holding [1, 2, 3] said "unknown field(s) [1, 2, 3]"."""
    from prisme.studies.recall_setup import study_config

    with pytest.raises(ValueError, match=r"recall_study.json must hold a JSON object of study settings .*got an array"):
        study_config({}, recall_configs(tmp_path, raw=[1, 2, 3]))


# -------------------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("argv, want", [
    (["--top-k", "5"], "--top-k 5 only shapes sampling, but --temperature is 0"),
    (["--top-p", "0.5"], "--top-p 0.5 only shapes sampling"),
    (["--top-k", "5", "--top-p", "0.5"], "--top-k 5 and --top-p 0.5 only shape sampling"),
    (["--lambda-cost", "0.1"], "--lambda-cost 0.1 only prices the workspace's edits, but --budget is 0"),
    (["--target-cost", "1.5"], "--target-cost 1.5 only prices")])
def test_generate_refuses_options_that_would_do_nothing(argv, want, capsys, monkeypatch):
    """`generate --top-k 5` (or `--top-p`) without a temperature decoded greedily without a word, and a price at
    budget 0 ran the backbone alone: an error naming both options, before the model loads."""
    import prisme.decoding.generate as gen

    monkeypatch.setattr(gen, "generate", boom)
    assert cli.main(["generate", "--preset", "demo", "--prompt", "Emma", *argv]) == 2
    err = error_of(capsys)
    assert want in err and "the work started" not in err


def test_an_unreachable_target_cost_is_an_error_both_ways(capsys):
    """`--target-cost 1000` ran at the costliest policy and exited 0, while a target below the cheapest policy's cost
    is an error: both are errors naming the reachable bound. Negative control: a reachable target runs."""
    base = ["generate", "--preset", "demo", "--prompt", "Emma", "--budget", "8", "--max-new-tokens", "2", "--seed", "0"]
    assert cli.main([*base, "--target-cost", "1000"]) == 2
    assert "target_cost=1000.0 is above the costliest controller policy's cost" in error_of(capsys)
    assert cli.main([*base, "--target-cost", "0.5"]) == 2
    assert "target_cost must be a finite number >= 1" in error_of(capsys)  # below the backbone alone: refused first
    assert cli.main([*base, "--target-cost", "1.5"]) == 0


# ------------------------------------------------------------------------------------------------------- OS errors
@pytest.mark.parametrize("argv", [["train", "--config", "demo_backbone", "--steps", "1"],
                                  ["study", "text", "--seeds", "1", "--scale", "0.01"], ["study", "recall", "--quick"],
                                  ["demo", "--scale", "0.01", "--recall-seeds", "none"]])
def test_an_out_naming_a_file_is_an_error_naming_the_option(argv, tmp_path, capsys, monkeypatch):
    """`--out` naming a file raised FileExistsError / NotADirectoryError: now an error naming --out, before any
    work."""
    import prisme.studies.runner as runner

    monkeypatch.setattr(runner, "run_tasks", boom)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli.main([*argv, "--out", str(afile)]) == 2
    err = error_of(capsys)
    assert f"--out {afile} is a file, not a folder" in err and "Error" not in err
    from prisme.training.resume import RunLock

    with pytest.raises(ValueError, match="is a file, not a folder"):  # a run folder named by a config file
        RunLock(afile)


def test_a_full_disk_while_recording_a_study_names_the_path(tmp_path, monkeypatch):
    """`File too large` (EFBIG from write or fsync carries no path) while writing the study's settings: the OSError
    names the file and what to do, keeps its errno, and leaves no temporary file; the next write succeeds."""
    import prisme.io as io
    from prisme.studies.runner import STUDY_DIR, record_study

    real = os.fsync

    def full(fd):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(OSError, match=r"could not write .*\.prisme-study/settings.json \(File too large\): the file "
                                      r"is over the file-size limit") as e:
        record_study(tmp_path / "s", {"study": {}})
    assert e.value.errno == errno.EFBIG and os.listdir(tmp_path / "s" / STUDY_DIR) == []
    monkeypatch.setattr(io.os, "fsync", real)
    record_study(tmp_path / "s", {"study": {}})
    assert (tmp_path / "s" / STUDY_DIR / "settings.json").is_file()
    with pytest.raises(FileExistsError, match="could not write .*a part of the path is a file"):
        io.write_text_atomic(tmp_path / "s" / STUDY_DIR / "settings.json" / "x.json", "{}")
