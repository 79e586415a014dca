"""An installed package runs everything: the wheel carries the recipes (package data), and `prisme --version` and
`prisme study recall --quick` run from it in a folder outside the source tree. Slow (a wheel build and a quick study,
about a minute): in the slow set, which CI runs after `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import prisme

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_installed_wheel_runs_the_recall_study_and_says_its_version(tmp_path):
    dist = tmp_path / "dist"
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                str(ROOT), cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    wheel = next(dist.glob("prisme-*.whl"))
    assert f"prisme-{prisme.__version__}-" in wheel.name  # one version: pyproject reads prisme.__version__
    site = tmp_path / "site"
    inst = run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel),
               cwd=tmp_path)
    assert inst.returncode == 0, inst.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy first (torch etc. from this interpreter)
    where = run(sys.executable, "-c", "import prisme; print(prisme.__file__)", cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(site)), where.stdout  # not the source tree
    version = run(sys.executable, "-m", "prisme", "--version", cwd=elsewhere, env=env)
    assert version.stdout.strip() == f"prisme {prisme.__version__}"
    study = run(sys.executable, "-m", "prisme", "study", "recall", "--quick", "--jobs", "1", "--out", "recall",
                "--no-progress", cwd=elsewhere, env=env)
    assert study.returncode == 0, study.stderr[-2000:]
    doc = json.loads(study.stdout[study.stdout.index("\n{") + 1:])
    assert doc["recipe"]["backbone"]["stage"] == "backbone" and (elsewhere / "recall").is_dir()
