"""`prisme fit`: a folder of code to a deployable PRISME model in one command (every stage of a recipe, resumable),
text in and text out from Python (`prisme.load`, `generate_text`), and the inputs it refuses before training. The
code recipe runs at its smallest scale on a synthetic folder of `.py` files the project never saw (seconds)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import prisme
from prisme import cli
from prisme.checkpoint import FIT_RECORD, find_model_checkpoint, read_meta
from prisme.studies.fit import fit

NAMES = ["alpha", "beta", "gamma", "parse", "render", "load", "store", "token"]


def write_code(root: Path, files: int = 12, seed: int = 0) -> Path:
    """`files` modules of small functions (about 5.5 kB each), and a file of another suffix that is left out."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        lines = [f'"""Module {i}."""', "", "import os", ""]
        for j in range(40):
            a, b = rng.choice(NAMES), rng.choice(NAMES)
            lines += [f"def {a}_{b}_{j}(x, y=None):", f'    """Return the {a} of {b}."""', "    if y is None:",
                      f"        y = {rng.randint(0, 99)}", f"    return {a}_{b}_helper(x) + y", ""]
        (root / f"pkg/mod{i}.py" if i % 2 else root / f"mod{i}.py").parent.mkdir(exist_ok=True)
        (root / f"pkg/mod{i}.py" if i % 2 else root / f"mod{i}.py").write_text("\n".join(lines))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")  # skipped: not a document suffix
    return root


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    code = write_code(root / "my_code")
    res = fit(code, "code", root / "mine", scale=0.002, progress=False)
    return root, code, res


def test_one_command_makes_a_model_whose_workspace_runs(fitted, capsys):
    """Every stage of the code recipe in its own folder (backbone, copy head, workspace, router), fit.json naming
    the deployable one; `generate` at budget 1 edits (the router fires at the model's default price); the folder
    stands for the model in every command."""
    root, code, res = fitted
    assert [Path(p).name for p in res.stages.values()] == ["1_backbone", "1c_copy", "2_workspace", "3_router"]
    assert json.loads((root / "mine" / FIT_RECORD).read_text())["checkpoint"] == "3_router"
    found = find_model_checkpoint(root / "mine")
    assert found.parent.name == "3_router" and read_meta(found).stage == "router"
    assert read_meta(found).config.copy_head and read_meta(found).config.bank_key == "preceding"
    manifest = json.loads((root / "mine" / "data" / "manifest.json").read_text())
    assert sum(manifest["documents"].values()) == 12 and manifest["skipped"] == [str(code / "logo.png")]
    rc = cli.main(["generate", "--checkpoint", str(root / "mine"), "--prompt", "def parse(", "--budget", "1",
                   "--max-new-tokens", "8", "--show-edits"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("def parse(")
    rows = [line for line in out.splitlines()[3:] if line[:5].strip().isdigit()]  # pos, token (8), edits (6), ...
    edits = [int(line[15:21]) for line in rows]
    assert len(edits) == 8 and sum(edits) > 0


def test_eval_of_a_fit_prints_the_router_rows_with_intervals(fitted, capsys):
    root, _, _ = fitted
    assert cli.main(["eval", "--checkpoint", str(root / "mine"), "--batches", "1", "--batch-size", "2",
                     "--policies", "backbone,fixed,router", "--bootstrap", "100"]) == 0
    out = capsys.readouterr().out
    router = [line for line in out.splitlines() if line.startswith("router(lambda=")]
    assert router and all("[" in line and "]" in line for line in router)  # each with its paired interval
    assert "untrained" not in "\n".join(router)  # the router stage trained what these rows run


def test_the_python_api_takes_text_and_returns_text(fitted):
    """`prisme.load` + `.generate`: the deployable budget from the trained stages, the edits visible per token;
    a list of prompts is one batch."""
    root, _, _ = fitted
    lm = prisme.load(root / "mine")
    assert lm.deployable_budget == 1 and lm.path.parent.name == "3_router"
    out = lm.generate("def parse(", max_new_tokens=6)
    assert out.text == "def parse(" + out.new_text and len(out.tokens) == 6 == len(out.edits)
    assert out.edits_per_token == sum(out.edits) / 6 > 0 and out.relative_cost > 1.0
    both = prisme.generate_text(lm, ["import ", "def "], 4, policy=prisme.Controller(max_budget=0))
    assert [o.edits for o in both] == [[0] * 4, [0] * 4] and both[0].relative_cost == 1.0  # the backbone alone
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        lm.generate("", 4)


def test_a_rerun_continues_and_other_settings_are_refused(fitted):
    """Rerunning the same fit trains nothing (each stage's checkpoint is kept) and gives the same model; another
    scale in the same folder is refused, naming the setting."""
    root, code, res = fitted
    before = {k: sorted(p.name for p in Path(v).glob("ckpt_*")) for k, v in res.stages.items()}
    again = fit(code, "code", root / "mine", scale=0.002, progress=False)
    assert again.checkpoint == res.checkpoint and again.wall_s < res.wall_s
    assert {k: sorted(p.name for p in Path(v).glob("ckpt_*")) for k, v in again.stages.items()} == before
    with pytest.raises(ValueError, match=r"holds a fit run with other settings \(scale: was 0.002, now 0.004\)"):
        fit(code, "code", root / "mine", scale=0.004, progress=False)


@pytest.mark.parametrize("case, named", [
    ("empty", "holds no readable document"),
    ("binary", "not valid UTF-8"),
    ("nul", "holds a NUL byte"),
    ("short", "the recipe reads windows of 1,024 tokens"),
    ("recipe", "--recipe must be one of text, long-context, code"),
    ("tokenizer", "tokenizer"),
    ("missing", "does not exist"),
])
def test_bad_input_is_refused_before_training_naming_the_file(tmp_path, case, named):
    data = tmp_path / "data"
    data.mkdir()
    recipe, kw = "code", {}
    if case == "binary":
        write_code(data, 2)
        (data / "bad.py").write_bytes(b"\xff\xfe\x00binary")
    elif case == "nul":
        write_code(data, 2)
        (data / "bad.py").write_text("x = 1\x00\n")
    elif case == "short":
        (data / "a.py").write_text("x = 1\n")
        (data / "b.py").write_text("y = 2\n")
    elif case == "recipe":
        recipe = "huge"
    elif case == "tokenizer":
        write_code(data, 2)
        kw["tokenizer"] = str(tmp_path / "no_such_tokenizer.json")
    elif case == "missing":
        data = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=named) as e:
        fit(data, recipe, tmp_path / "out", scale=0.002, progress=False, **kw)
    if case in ("binary", "nul"):
        assert "bad.py" in str(e.value)  # the file named
    assert not list((tmp_path / "out").glob("1_backbone"))  # nothing trained


def test_data_prepare_and_tokenizer_train_read_source_files(tmp_path, capsys):
    """`.py` files are documents by default, other suffixes with --ext; the tokenizer trains on a folder of code."""
    code = write_code(tmp_path / "code", 3)
    (code / "extra.js").write_text("function f(x) { return x + 1; }\n" * 20)
    assert cli.main(["data", "prepare", str(code), "--out", str(tmp_path / "a")]) == 0
    assert cli.main(["data", "prepare", str(code), "--out", str(tmp_path / "b"), "--ext", "js"]) == 0
    a, b = (json.loads((tmp_path / f / "manifest.json").read_text()) for f in ("a", "b"))
    assert sum(a["documents"].values()) == 3 and sum(b["documents"].values()) == 4
    assert str(code / "extra.js") in a["skipped"] and str(code / "extra.js") not in b["skipped"]
    pytest.importorskip("tokenizers")
    assert cli.main(["tokenizer", "train", "--corpus", str(code), "--vocab-size", "300",
                     "--out", str(tmp_path / "bpe.json")]) == 0
    assert (tmp_path / "bpe.json").is_file()


def test_an_unfinished_fit_folder_is_named_as_such(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / FIT_RECORD).write_text(json.dumps({"settings": {}, "stages": {}, "checkpoint": None}))
    with pytest.raises(ValueError, match="holds a fit that has not finished"):
        find_model_checkpoint(tmp_path / "f")
    with pytest.raises(ValueError, match="policy 'router' needs a router model"):
        from prisme.config import PrismeConfig
        from prisme.evaluation.families import standard_policies
        from prisme.model.prisme import PrismeModel

        model = PrismeModel(PrismeConfig.from_name("tiny"))
        standard_policies(model, ["router"])[0].plan(model, None)
