"""The Policy interface: adding a family is one class (its rows, run, price and place in the report come with it), and
no module outside the policy classes branches on a family's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from prisme.costs.traces import trace_cost
from prisme.data.text import TokenDataset
from prisme.data.tokenizers import ByteTokenizer
from prisme.evaluation.policies import ROW_KINDS, BackboneRows, ForcedRows, Policy, RowKind
from prisme.evaluation.run import EvalOptions, evaluate_policies
from prisme.model.oracle import token_ce

PACKAGE = Path(__file__).resolve().parent.parent / "prisme"


class EveryOther(ForcedRows):
    """A new family, for the test: n round-robin single-slot edits at even positions, nothing at odd ones."""

    kinds = (RowKind("every_other", "d", "C9", workspace=True),)

    def actions(self, cfg, n, k, shape, generator):
        B, T = shape
        acts = (torch.arange(n) % cfg.n_slots).view(1, 1, n).expand(B, T, n).clone()
        acts[:, 1::2] = cfg.stop_action
        return acts


def test_a_new_family_is_one_class_with_its_rows_price_and_report():
    """A ForcedRows subclass with its own kind gives rows named by it, whose loss is the model's on its actions, whose
    ops are the cost model's price of that trace, and which the table and the plot show."""
    model = tiny_model(vocab_size=256)
    ds = TokenDataset.from_text("the cat sat on the mat and the dog ran home " * 40, ByteTokenizer(),
                                val_fraction=0.5)
    report = evaluate_policies(model, ds, [BackboneRows(), EveryOther([1, 2], (1,))],
                               EvalOptions(batch_size=2, seq_len=16, max_batches=2, bootstrap_samples=20))
    assert [r.policy for r in report.rows] == ["backbone", "every_other_1xk1", "every_other_2xk1"]
    batches = list(ds.iter_eval("val", 2, 16, 2))
    for row, n in zip(report.rows[1:], (1, 2)):
        ce, acts = [], []
        for x, y in batches:
            a = EveryOther().actions(model.cfg, n, 1, tuple(x.shape), None).long()
            with torch.no_grad():
                ce.append(token_ce(model(x, a).logits, y).double().flatten())
            acts.append(a.reshape(-1, n))
        assert row.family == "every_other" and row.loss == pytest.approx(float(torch.cat(ce).mean()), abs=1e-12)
        cost = trace_cost(model.cfg, torch.cat(acts), torch.arange(1, 17).repeat(4), optimised=model.cfg.optimised)
        assert row.relative_ops == pytest.approx(cost.relative, rel=1e-12) and row.mean_edits == n / 2
    assert "every_other_2xk1" in report.table() and ROW_KINDS["every_other"].marker == "d"


def test_a_family_name_is_declared_once():
    """Two classes that declare the same family are refused (negative control for the registry)."""
    with pytest.raises(ValueError, match="declared twice"):
        class Again(Policy):  # noqa: F841 - its definition is the test
            kinds = (RowKind("fixed", "o", "C0", workspace=True),)


def family_comparisons(root: Path) -> list[str]:
    """`x == "name"` / `!=` / `in ("name", ...)` comparisons of a family's name outside the policy classes, where the
    compared expression is a row's or entry's family (its source text says `family`)."""
    names = set(ROW_KINDS) | {"every_other"}
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "policies.py" and path.parent.name == "evaluation":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            parts = [node.left, *node.comparators]
            consts = {c.value for p in parts for c in ast.walk(p) if isinstance(c, ast.Constant)}
            if consts & names and any("family" in ast.unparse(p) for p in parts):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_branches_on_a_family_name(tmp_path):
    """Outside `evaluation/policies.py` nothing compares a row's family with a family's name; the check sees one
    planted in a copy of a module (negative control)."""
    assert family_comparisons(PACKAGE) == []
    copy = tmp_path / "prisme" / "evaluation"
    copy.mkdir(parents=True)
    (copy / "report.py").write_text("def f(r):\n    return r.family == 'oracle'\n")
    assert family_comparisons(tmp_path / "prisme") == ["prisme/evaluation/report.py:2: r.family == 'oracle'"]
