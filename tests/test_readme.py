"""The README is what a newcomer runs: at most 12,000 bytes, and its quick-start and own-data commands and its Python
example run as written. The test runs them on a synthetic folder of `.py` files at the smallest scale, with only the
data folder, the scale, the output folder and the evaluation's size changed (documented in `as_run`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_fit import write_code

from prisme import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def commands(block: str) -> list[list[str]]:
    """The `prisme ...` lines of a bash block (`.venv/bin/prisme` too), comments dropped, as argv lists."""
    out = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith((".venv/bin/prisme ", "prisme ")):
            out.append(shlex.split(line)[1:])
    return out


def as_run(argv: list[str], data: Path, out: Path) -> list[str]:
    """What the test changes: the data folder (`my_code/`, `prisme`: a synthetic folder), `--scale` (0.002, the
    smallest), the output folder (`runs/...`: a temporary one) and eval's size (one batch of two windows)."""
    argv = [str(data) if a in ("my_code/", "prisme") and argv[0] == "fit" else a for a in argv]
    argv = [str(out / Path(a).name) if a.startswith("runs/") else a for a in argv]
    if "--scale" in argv:
        argv[argv.index("--scale") + 1] = "0.002"
    if argv[0] == "eval":
        argv[argv.index("--batches") + 1] = "1"
        argv += ["--batch-size", "2", "--bootstrap", "100"]
    return argv


def test_the_readme_is_short():
    assert len(README.read_bytes()) <= 12_000


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    return write_code(root / "code", 12), root


def test_the_own_code_commands_and_the_python_example_run_as_written(own_data, capsys):
    """fit -> generate (the workspace edits at budget 1) -> eval (every policy with its interval), then the Python
    block prints generated text from that checkpoint."""
    data, out = own_data
    own = next(b for b in blocks("bash") if "prisme fit my_code/" in b)
    argvs = commands(own)
    assert [a[0] for a in argvs] == ["fit", "generate", "eval"]
    for argv in argvs:
        assert cli.main(as_run(argv, data, out)) == 0, argv
    printed = capsys.readouterr().out
    assert "def parse(" in printed and "router(lambda=" in printed
    code = blocks("python")[0].replace('"runs/mine"', repr(str(out / "mine")))
    exec(compile(code, "README python block", "exec"), {})
    assert capsys.readouterr().out.startswith("def parse(")


def test_the_quick_start_runs_as_written(own_data, capsys):
    data, out = own_data
    argvs = commands(next(b for b in blocks("bash") if "make test" in b))
    assert [a[0] for a in argvs] == ["fit", "generate"]
    for argv in argvs:
        assert cli.main(as_run(argv, data, out)) == 0, argv
    assert re.search(r"^def ", capsys.readouterr().out, re.M)  # the generated text, after the fit's lines
