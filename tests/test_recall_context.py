"""The long-context recall study (`prisme study recall --frontier --context`): per length, a task whose every query's
pair lies beyond the largest attention window, the grid's runs in their own folders, bad lengths refused before
anything trains, and (slow set) a quick run's document and table."""

from __future__ import annotations

import json
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch

from prisme import cli
from prisme.data.mqar import make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.studies.recall import plan_tasks
from prisme.studies.recall_context import context_mqar, largest_window, recipe_at
from prisme.studies.recall_frontier import DenseTask, FamilyTask
from prisme.studies.recall_setup import RecallStudyConfig, load_recipe


def study(**overrides) -> RecallStudyConfig:
    return RecallStudyConfig(frontier=True, quick=True, seeds=[0], **overrides).validate()


def test_every_query_lies_beyond_every_window_of_the_grid():
    """At each length the queries start after 2N + W_max, so no local model's window (t-W+1 .. t) holds the queried
    pair; the task keeps its vocabulary and pairs, with `context_queries` queries. Negative control: the recipe's own
    T = 32 layout puts queries inside a 64-position window."""
    cfg = study(contexts=[96, 256])
    recipe, _ = load_recipe(cfg)
    W = largest_window(cfg)
    assert W == 64
    for T in cfg.contexts:
        mcfg = context_mqar(cfg, recipe, T)
        x, y = make_mqar_batch(mcfg, 64, torch.Generator().manual_seed(T))
        pos = (y != IGNORE_INDEX).nonzero()[:, 1]
        last_pair = 2 * mcfg.n_pairs - 1
        assert x.shape == (64, T) and int((y != IGNORE_INDEX).sum(1).min()) == cfg.context_queries
        assert bool((pos - W + 1 > last_pair).all())  # the window of every query starts after the pairs
    x, y = make_mqar_batch(recipe.mqar, 64, torch.Generator().manual_seed(0))
    assert bool(((y != IGNORE_INDEX).nonzero()[:, 1] - W + 1 <= 2 * recipe.mqar.n_pairs - 1).all())


def test_each_length_plans_the_grid_in_its_own_folder_at_its_length(tmp_path):
    """Per length: every `context_dense` configuration and `context_family` member, in frontier/T{T}/, the model's
    T_max and every stage's task at that length, at `context_batch_size`; the windows and key shifts are the
    models' own; the controls run as always."""
    cfg = study(contexts=[96, 128], out_dir=str(tmp_path))
    recipe, _ = load_recipe(cfg)
    tasks = plan_tasks(cfg, recipe)
    n_dense = sum(len(b["depths"]) * len(b["widths"]) for b in cfg.context_dense)
    for T in (96, 128):
        mine = [t for t in tasks if getattr(t, "context", None) == T]
        dense = [t for t in mine if isinstance(t, DenseTask)]
        family = [t for t in mine if isinstance(t, FamilyTask)]
        assert len(dense) == n_dense and len(family) == 1  # quick: the first family member
        assert all(t.folder.startswith(str(tmp_path / "frontier" / f"T{T}")) for t in mine)
        assert all(t.model.max_seq_len == T and t.mqar.seq_len == T for t in mine)
        assert all(s.mqar["seq_len"] == T and s.batch_size == cfg.context_batch_size for t in mine for s in t.stages)
        assert {(t.model.key_shift, t.model.attn_window) for t in dense} == {(False, None), (True, None),
                                                                            (False, 64), (True, 64)}
        assert family[0].model.attn_window == 64 and family[0].model.router and family[0].name == f"T{T}_d16_w32_win64"
    assert sum(t.kind == "control" for t in tasks) == 2
    assert recipe_at(cfg, recipe, 96).router.mqar["query_min_pos"] == 2 * recipe.mqar.n_pairs + 64


@pytest.mark.parametrize("argv, msg", [
    (["--frontier", "--context", "5000"], "T_max"),
    (["--frontier", "--context", "70"], "cannot hold"),
    (["--frontier", "--context", "256,256"], "--context"),
    (["--frontier", "--context", "a,b"], "--context"),
    (["--context", "256"], "needs --frontier"),
])
def test_a_bad_context_is_a_one_line_error_before_anything_trains(tmp_path, capsys, argv, msg):
    """Over the preset's T_max, too short for the queries beyond the windows, repeated, not numbers, or without
    --frontier: exit 2 with a message naming it, and no study folder."""
    out = tmp_path / "s"
    assert cli.main(["study", "recall", "--quick", "--out", str(out), "--no-progress", *argv]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # about 40 s: `make test-slow` (and CI) run it
def test_a_quick_long_context_study_writes_each_length_and_the_ratio(tmp_path):
    """`--frontier --quick --context 96,128`: the document holds each length's task and frontier (its longest as
    `frontier`), the ratio per length and the plot; the table shows both lengths."""
    out = tmp_path / "c"
    buf = StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["study", "recall", "--frontier", "--quick", "--context", "96,128", "--jobs", "1", "--out",
                       str(out), "--no-progress"])
    assert rc == 0
    text = buf.getvalue()
    doc = json.loads(text[text.index("\n{") + 1:])
    assert [c["T"] for c in doc["contexts"]] == [96, 128] and [r["T"] for r in doc["ratio_by_context"]] == [96, 128]
    assert doc["frontier"] == doc["contexts"][-1]["frontier"]
    for c in doc["contexts"]:
        assert c["task"]["seq_len"] == c["T"] and c["frontier"]["dense"] and c["frontier"]["prisme"]
    assert "T = 96" in text and "T = 128" in text and (out / "recall_context_ratio.png").stat().st_size > 0
