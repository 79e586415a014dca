"""`prisme.evaluation`: every policy's loss and ops are what an independent computation gives (SPEC §5, §6).

Tiny preset in float64 with a non-zero readout (U starts at zero, which would hide every edit). The greedy oracle is
not guaranteed to beat a fixed n-step policy for n > 1 (it is myopic, and budget conditioning differs), so the tests
check what holds by construction: at budget 1 it equals the best single action, and at every step its choice is the
largest true loss drop over all candidates (brute force through `model.forward`).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F
from tiny_models import evaluate, tiny_model

from prisme import cli
from prisme.checkpoint import TrainingState, save_checkpoint
from prisme.config import PrismeConfig
from prisme.costs.analytic import token_ops
from prisme.data.mqar import MQARConfig, MQARDataset, mqar_accuracy
from prisme.data.text import IGNORE_INDEX, TokenDataset
from prisme.data.tokenizers import ByteTokenizer
from prisme.evaluation.oracle import greedy_oracle
from prisme.evaluation.policies import forced_actions, sample_positions
from prisme.evaluation.report import EvalRow, pareto_front
from prisme.model.prisme import PrismeModel
from prisme.training.config import StageConfig

B, T, NB, SEED = 3, 16, 2, 7  # batch size, sequence length, batches, evaluation seed


def make_model(seed: int = 0, **overrides) -> PrismeModel:
    return tiny_model(seed, **overrides)


def text_dataset() -> TokenDataset:
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "home"]
    return TokenDataset.from_text(" ".join(rng.choice(words) for _ in range(600)), ByteTokenizer(), val_fraction=0.25)


def ce_sum(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy `[...]` over labelled targets and their count."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none").view(y.shape)
    return ce.sum(), (y != IGNORE_INDEX).sum()


def per_position_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view(y.shape)


@pytest.fixture(scope="module")
def run():
    """One full evaluation (every policy family) of a tiny byte-level model on a short generated text."""
    model = make_model(vocab_size=256)
    ds = text_dataset()
    report = evaluate(model, ds, batch_size=B, seq_len=T, max_batches=NB, oracle_positions=4, seed=SEED)
    return model, ds, report


# ---------------------------------------------------------------------------------------------------------- loss
def test_backbone_row_equals_plain_forward_loss(run):
    """The backbone-only row is the token-weighted mean CE of backbone.head(backbone(x)) over the val windows."""
    model, ds, report = run

    def reference(split: str) -> float:
        tot, n = 0.0, 0
        with torch.no_grad():
            for x, y in ds.iter_eval(split, B, T, NB):
                s, c = ce_sum(model.backbone.head(model.backbone(x)), y)
                tot, n = tot + float(s), n + int(c)
        return tot / n

    row = report.row("backbone")
    assert abs(row.loss - reference("val")) <= 1e-12
    assert row.delta_loss == 0.0 and row.mean_edits == 0.0 and row.relative_ops == 1.0 and row.deployable
    assert abs(row.loss - reference("train")) > 1e-6  # negative control: reading the wrong split is caught


def test_forced_rows_equal_direct_computation_with_the_same_actions(run):
    """fixed, random and dense rows equal the mean CE of model(x, actions) with the documented forced actions."""
    model, ds, report = run
    rows = [r for r in report.rows if r.family in ("fixed", "random", "dense")]
    assert {r.family for r in rows} == {"fixed", "random", "dense"}
    assert {r.budget for r in rows} == {1, 2, 4}  # {1, 2, 4, 8} capped at r_max = 4

    def reference(r: EvalRow, seed: int) -> float:
        k = int(r.policy.split("xk")[1]) if "xk" in r.policy else model.cfg.n_slots
        tot, n = 0.0, 0
        with torch.no_grad():
            for bi, (x, y) in enumerate(ds.iter_eval("val", B, T, NB)):
                g = torch.Generator().manual_seed(seed + bi)
                acts = forced_actions(model.cfg, r.family, r.budget, k, (B, T), g)
                s, c = ce_sum(model(x, acts).logits, y)
                tot, n = tot + float(s), n + int(c)
        return tot / n

    for r in rows:
        assert abs(r.loss - reference(r, SEED)) <= 1e-12, r.policy
        assert r.mean_edits == r.budget and r.controller_steps == 0.0
    for r in (r for r in rows if r.family == "random"):  # negative control: other random actions are caught
        assert abs(r.loss - reference(r, SEED + 100)) > 1e-9, r.policy


def test_forced_actions_follow_the_round_robin_and_dense_definitions():
    """fixed k1 cycles slots 0..M-1, fixed k2 cycles pairs M..A-1, dense is A+1, random k2 draws only pairs."""
    cfg = PrismeConfig.from_name("tiny")  # M = 4, A = 6
    assert forced_actions(cfg, "fixed", 6, 1, (1, 1))[0, 0].tolist() == [0, 1, 2, 3, 0, 1]
    assert forced_actions(cfg, "fixed", 3, 2, (1, 1))[0, 0].tolist() == [4, 5, 4]
    assert forced_actions(cfg, "dense", 2, 4, (1, 1))[0, 0].tolist() == [7, 7]
    r = forced_actions(cfg, "random", 4, 2, (8, 8), torch.Generator().manual_seed(0))
    assert r.min() >= 4 and r.max() <= 5 and r.unique().numel() == 2
    with pytest.raises(ValueError, match="unknown family"):
        forced_actions(cfg, "greedy", 1, 1, (1, 1))


# ---------------------------------------------------------------------------------------------------------- ops
def test_fixed_row_ops_equal_token_ops_at_each_positions_own_context(run):
    """Forced rows' ops/token are token_ops(t + 1, n x [k], no controller) averaged over positions, both accountings."""
    model, _, report = run
    cfg = model.cfg
    rows = [r for r in report.rows if r.family in ("fixed", "dense")]

    def mean_total(ks: list[int], optimised: bool, contexts: list[int]) -> float:
        return sum(token_ops(cfg, c, ks, controller_steps=0, optimised=optimised)["total"]
                   for c in contexts) / len(contexts)

    own = list(range(1, T + 1))  # position t has t + 1 keys
    base = mean_total([], cfg.optimised, own)
    for r in rows:
        ks = [1 if r.policy.endswith("k1") else 2 if r.policy.endswith("k2") else cfg.n_slots] * r.budget
        expected = mean_total(ks, cfg.optimised, own)
        assert r.ops_per_token == pytest.approx(expected, rel=1e-12), r.policy
        assert r.relative_ops == pytest.approx(expected / base, rel=1e-12)
        assert r.ops_per_token_alt == pytest.approx(mean_total(ks, not cfg.optimised, own), rel=1e-12)
        # negative control: charging every position the full context T would be caught
        wrong = mean_total(ks, cfg.optimised, [T] * T)
        assert abs(wrong - r.ops_per_token) > 1e-6 * r.ops_per_token
    assert report.row("backbone").ops_per_token == pytest.approx(base, rel=1e-12)


def test_controller_row_ops_are_charged_from_its_own_trace_and_controller_steps(run):
    """A controller row's ops equal the per-position token_ops of the trace forward_policy produced, with its steps."""
    model, ds, report = run
    cfg = model.cfg
    row = next(r for r in report.rows if r.family == "controller" and r.lambda_cost == 0.0)
    stop, tot, n, tot_forced = cfg.stop_action, 0.0, 0, 0.0
    with torch.no_grad():
        for x, _ in ds.iter_eval("val", B, T, NB):
            out = model.forward_policy(x, max_budget=cfg.r_max, lambda_cost=0.0)
            for b in range(B):
                for t in range(T):
                    ks = [1 if a < cfg.n_slots else 2 for a in out.actions[b, t].tolist() if a != stop]
                    steps = int(out.controller_steps[b, t])
                    assert steps == min(len(ks) + 1, cfg.r_max)
                    tot += token_ops(cfg, t + 1, ks, controller_steps=steps, optimised=cfg.optimised)["total"]
                    if ks:  # the same trace charged as a forced policy (no controller)
                        tot_forced += token_ops(cfg, t + 1, ks, controller_steps=0, optimised=cfg.optimised)["total"]
                    n += 1
    assert row.ops_per_token == pytest.approx(tot / n, rel=1e-12)
    assert row.controller_steps > 1.0 and 0 < row.edited_fraction <= 1
    assert abs(tot_forced / n - row.ops_per_token) > 1e-6 * row.ops_per_token  # negative control: no controller charge


# ---------------------------------------------------------------------------------------------------------- controller
def spans_and_is_monotone(rows: list[EvalRow]) -> bool:
    """Rows sorted by lambda: edits and ops never increase, and the largest lambda edits less than lambda = 0."""
    rows = sorted(rows, key=lambda r: r.lambda_cost)
    edits, ops = [r.mean_edits for r in rows], [r.ops_per_token for r in rows]
    monotone = all(a >= b for a, b in zip(edits, edits[1:])) and all(a >= b for a, b in zip(ops, ops[1:]))
    return monotone and edits[-1] < edits[0]


def test_controller_rows_give_fewer_edits_and_ops_as_lambda_grows(monkeypatch):
    """With values fixed per action (pairs > singles), lambda moves the choice pair -> single -> STOP, monotonically."""
    model = make_model(vocab_size=256)
    cfg, M = model.cfg, model.cfg.n_slots
    c1, c2 = float(model.action_cost[0]), float(model.action_cost[M])
    with torch.no_grad():  # W_act = 0 makes value_a = b_v[a]: pairs win below lambda 0.5, singles below 1
        model.controller.W_act.weight.zero_()
        model.controller.b_v[:M] = c1
        model.controller.b_v[M:] = c1 + 0.5 * (c2 - c1)
    ds, lambdas = text_dataset(), [0.0, 0.25, 0.75, 2.0]
    report = evaluate(model, ds, ["controller"], batch_size=B, seq_len=T, max_batches=1, lambdas=lambdas)
    rows = [r for r in report.rows if r.family == "controller"]
    assert [r.mean_edits for r in rows] == [cfg.r_max, cfg.r_max, cfg.r_max, 0]
    assert rows[0].ops_per_token == rows[1].ops_per_token > rows[2].ops_per_token > rows[3].ops_per_token
    assert rows[3].controller_steps == 1.0 and rows[3].relative_ops > 1.0  # one controller step + the bank
    assert spans_and_is_monotone(rows)

    select = model.controller.select  # negative control: a controller blind to lambda fails the check
    monkeypatch.setattr(model.controller, "select", lambda preds, cost, lam=None, kap=None: select(preds, cost, 0.0))
    broken = evaluate(model, ds, ["controller"], batch_size=B, seq_len=T, max_batches=1, lambdas=lambdas)
    assert not spans_and_is_monotone([r for r in broken.rows if r.family == "controller"])


def test_default_lambda_grid_spans_and_edited_fraction_is_monotone(run):
    """The calibrated grid starts at 0; the fraction of positions that edit at all never grows with lambda."""
    _, _, report = run
    rows = sorted((r for r in report.rows if r.family == "controller"), key=lambda r: r.lambda_cost)
    assert rows[0].lambda_cost == 0.0 and len(rows) >= 3
    frac = [r.edited_fraction for r in rows]
    assert all(a >= b for a, b in zip(frac, frac[1:]))  # step 0 sees S0 whatever lambda: guaranteed
    assert frac[0] > frac[-1]  # the grid spans (and the monotonicity check above is not vacuous)


# ---------------------------------------------------------------------------------------------------------- oracle
def oracle_violations(model: PrismeModel, x: torch.Tensor, y: torch.Tensor, res, lam: float) -> int:
    """Brute force through model.forward: count steps where the oracle's choice is not the best true drop - lam*cost
    (or STOP when none is positive), and positions whose final loss differs from a forced replay of its trace."""
    cfg = model.cfg
    stop, A = cfg.stop_action, cfg.n_actions
    Bq, R = res.positions.shape[0], res.actions.shape[-1]
    rows = torch.arange(Bq).unsqueeze(1)
    yq = y[rows, res.positions]

    def loss_of(steps: torch.Tensor) -> torch.Tensor:  # steps [B, P, r] at the sampled positions
        if steps.shape[-1] == 0:
            return per_position_ce(model(x).logits[rows, res.positions], yq)
        acts = torch.full((*x.shape, steps.shape[-1]), stop, dtype=torch.long)
        acts[rows, res.positions] = steps
        return per_position_ce(model(x, acts, budget=R).logits[rows, res.positions], yq)

    bad = 0
    with torch.no_grad():
        for r in range(R):
            prefix = res.actions[:, :, :r]
            active = (prefix != stop).all(-1)
            prev = loss_of(prefix)
            cand = torch.stack([loss_of(torch.cat([prefix, torch.full((*prefix.shape[:2], 1), a)], -1))
                                for a in range(A)], -1)  # [B, P, A]
            best, a = (prev.unsqueeze(-1) - cand - lam * model.action_cost).max(-1)
            expected = torch.where(best > 0, a, torch.full_like(a, stop))
            bad += int(((expected != res.actions[:, :, r]) & active).sum())
            bad += int(((res.actions[:, :, r] != stop) & ~active).sum())
        bad += int(((loss_of(res.actions) - res.loss).abs() > 1e-10).sum())
    return bad


@pytest.mark.parametrize("lam", [0.0, 0.02])
def test_oracle_takes_the_largest_true_loss_drop_at_every_step(lam):
    """Each oracle step's action is the argmax of the brute-force true drop minus lambda*cost, else STOP."""
    model = make_model(vocab_size=64)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 64, (2, 10), generator=g), torch.randint(0, 64, (2, 10), generator=g)
    pos = torch.tensor([[2, 5, 9], [0, 4, 7]])
    res = greedy_oracle(model, x, y, pos, lambda_cost=lam)
    assert 0 < int(res.n_edits.sum()) and (res.actions == model.cfg.stop_action).any()  # edits and stops to check
    assert bool((res.loss <= res.base_loss).all())
    assert oracle_violations(model, x, y, res, lam) == 0

    b, p = (res.actions[:, :, 0] != model.cfg.stop_action).nonzero()[0].tolist()  # negative control: a wrong pick
    bad = replace(res, actions=res.actions.clone())
    bad.actions[b, p, 0] = (res.actions[b, p, 0] + 1) % model.cfg.n_actions
    assert oracle_violations(model, x, y, bad, lam) > 0


def test_oracle_at_budget_one_is_never_worse_than_any_single_step_policy():
    """At budget 1 and lambda 0 the oracle's loss is min(backbone, best candidate action) at every position, so never
    worse than fixed 1xk1, fixed 1xk2 or random 1xk1 at equal budget (DENSE is not a candidate, so dense 1 can be)."""
    model = make_model(vocab_size=64)
    cfg = model.cfg
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 64, (3, 12), generator=g), torch.randint(0, 64, (3, 12), generator=g)
    pos = sample_positions(y, 5, torch.Generator().manual_seed(0))[1]
    rows = torch.arange(3).unsqueeze(1)
    res = greedy_oracle(model, x, y, pos, max_budget=1)

    def loss_with(acts: torch.Tensor) -> torch.Tensor:  # [B, T, 1] -> [B, P]
        with torch.no_grad():
            return per_position_ce(model(x, acts, budget=1).logits[rows, pos], y[rows, pos])

    singles = torch.stack([loss_with(torch.full((3, 12, 1), a)) for a in range(cfg.n_actions)], -1)  # [B, P, A]
    best = torch.minimum(res.base_loss, singles.min(-1).values)
    assert torch.allclose(res.loss, best, rtol=0, atol=1e-10)
    others = {"fixed_1xk1": forced_actions(cfg, "fixed", 1, 1, (3, 12)),
              "fixed_1xk2": forced_actions(cfg, "fixed", 1, 2, (3, 12)),
              "random_1xk1": forced_actions(cfg, "random", 1, 1, (3, 12), torch.Generator().manual_seed(1))}
    for name, acts in others.items():
        assert bool((res.loss <= loss_with(acts) + 1e-12).all()), name
    assert bool((singles.max(-1).values > res.loss + 1e-9).any())  # negative control: a worst-pick would be caught


def test_oracle_rows_are_flagged_not_deployable_and_charged_as_a_controller(run):
    """Oracle rows cover only sampled labelled positions, are not deployable, and pay min(n+1, budget) steps."""
    model, _, report = run
    rows = [r for r in report.rows if r.family == "oracle"]
    assert rows and all(not r.deployable for r in rows)
    assert all(r.n_positions == NB * B * 4 == r.n_targets for r in rows)  # oracle_positions = 4 per sequence
    r0 = next(r for r in rows if r.lambda_cost == 0.0)
    assert r0.delta_loss < 0 and r0.mean_edits > 0
    assert 1.0 <= r0.controller_steps <= min(r0.mean_edits + 1, model.cfg.r_max) + 1e-12
    assert r0 not in pareto_front(report.rows)


# ---------------------------------------------------------------------------------------------------------- MQAR
class FixedMQAR(MQARDataset):
    """MQAR-typed dataset whose val batches are given: the accuracy path with a known answer."""

    def __init__(self, batches):
        super().__init__()
        self._batches = batches

    def iter_eval(self, split, batch_size, seq_len=None, max_batches=None):
        yield from self._batches


def test_mqar_accuracy_counts_labelled_positions_only():
    """Accuracy is the argmax hit rate on labelled targets: exactly 0.5 when half the labels are the argmax."""
    model = make_model(vocab_size=64)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(x).logits
    pred = logits.argmax(-1)
    y = torch.full_like(x, IGNORE_INDEX)
    y[:, 4:12:2] = pred[:, 4:12:2]  # right
    y[:, 5:13:2] = (pred[:, 5:13:2] + 1) % 64  # wrong
    report = evaluate(model, FixedMQAR([(x, y)]), ["backbone"], batch_size=2, seq_len=16)
    row = report.row("backbone")
    assert row.accuracy == 0.5 and row.n_targets == 16 and report.n_tokens == 16
    assert mqar_accuracy(logits, y) == 0.5
    # negative control: a loss averaged over every position (ignored ones as 0) would be caught
    s, _ = ce_sum(logits, y)
    assert abs(float(s) / x.numel() - row.loss) > 1e-6 and abs(float(s) / 16 - row.loss) <= 1e-12


def test_mqar_rows_match_mqar_accuracy_and_masked_loss():
    """On real MQAR batches every row reports accuracy; the backbone row equals mqar_accuracy and the masked CE."""
    model = make_model()  # tiny: vocab 64, the default MQAR vocabulary
    ds = MQARDataset(MQARConfig())
    report = evaluate(model, ds, ["backbone", "fixed", "oracle"], batch_size=4, max_batches=2,
                               lambdas=[0.0], oracle_positions=2)
    tot, n, accs = 0.0, 0, []
    with torch.no_grad():
        for x, y in ds.iter_eval("val", 4, 32, 2):
            logits = model(x).logits
            s, c = ce_sum(logits, y)
            tot, n = tot + float(s), n + int(c)
            accs.append(mqar_accuracy(logits, y))
    row = report.row("backbone")
    assert n == 2 * 4 * 4 == row.n_targets
    assert abs(row.loss - tot / n) <= 1e-12 and row.accuracy == pytest.approx(sum(accs) / 2, abs=1e-15)
    assert all(r.accuracy is not None for r in report.rows)
    assert report.row("oracle(lambda=0)").n_targets == 2 * 4 * 2  # two labelled positions per sequence
    assert report.rows[-1].n_positions == 16 and report.row("fixed_1xk1").n_positions == 2 * 4 * 32


# ---------------------------------------------------------------------------------------------------------- matched
def test_matched_backbone_row_is_that_backbone_alone():
    """The matched row is the other model's backbone-only loss, at this model's backbone cost (same architecture)."""
    model = make_model(vocab_size=256)
    matched = make_model(seed=1, vocab_size=256, use_workspace=False)
    ds = text_dataset()
    report = evaluate(model, ds, ["backbone", "matched"], batch_size=B, seq_len=T, max_batches=NB,
                               matched_backbone=matched)
    tot, n = 0.0, 0
    with torch.no_grad():
        for x, y in ds.iter_eval("val", B, T, NB):
            s, c = ce_sum(matched(x).logits, y)
            tot, n = tot + float(s), n + int(c)
    row = report.row("backbone+matched")
    assert abs(row.loss - tot / n) <= 1e-12 and row.relative_ops == 1.0 and row.deployable
    assert abs(row.loss - report.row("backbone").loss) > 1e-6  # negative control: not this model's backbone


# ---------------------------------------------------------------------------------------------------------- outputs
def test_json_is_strict_and_png_is_written(run, tmp_path):
    """to_json survives json.dumps(allow_nan=False) (NaN -> null), the table has a line per row, the PNG is written."""
    model, _, report = run
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert [r["policy"] for r in doc["rows"]] == [r.policy for r in report.rows]
    assert doc["n_tokens"] == NB * B * T and doc["config"]["name"] == "tiny"
    assert doc["environment"]["torch"] == torch.__version__ and doc["accounting"] == "optimised"
    assert doc["rows"][0]["loss"] == report.rows[0].loss
    nan_report = replace(report, rows=[replace(report.rows[0], ops_per_token_alt=float("nan"))])
    assert json.loads(json.dumps(nan_report.to_json(), allow_nan=False))["rows"][0]["ops_per_token_alt"] is None
    with pytest.raises(ValueError):  # negative control: the raw dataclass is not strict JSON
        json.dumps(asdict(nan_report), allow_nan=False)
    table = report.table().splitlines()
    n_eq = sum(r.delta_vs_equal_edits is not None for r in report.rows)  # one comparison line under each controller
    assert len(table) == len(report.rows) + n_eq + 3 and all(any(ln.startswith(r.policy) for ln in table)
                                                              for r in report.rows)
    path = tmp_path / "sub" / "pareto.png"
    report.plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_pareto_front_keeps_only_undominated_deployable_rows():
    """The front is sorted by ops, strictly improving in loss, and ignores non-deployable rows."""
    def row(name: str, loss: float, rel: float, dep: bool = True) -> EvalRow:
        return EvalRow(name, loss, rel, rel, None, dep)

    rows = [row("a", 3.0, 1.0), row("b", 2.5, 2.0), row("c", 2.8, 3.0), row("d", 2.0, 5.0), row("o", 1.0, 1.5, False)]
    assert [r.policy for r in pareto_front(rows)] == ["a", "b", "d"]


# ---------------------------------------------------------------------------------------------------------- errors
def test_bad_inputs_raise_value_error_and_leave_the_model_alone():
    """Empty or unlabelled datasets, unknown policies, max_batches < 1 and a missing matched model raise ValueError."""
    model = make_model(vocab_size=256).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ds = text_dataset()
    cases = [
        (lambda: evaluate(model, TokenDataset([1, 2, 3], val_fraction=0.0, vocab_size=256)), "too small"),
        (lambda: evaluate(model, MQARDataset(n_eval_batches=0), max_batches=None, seq_len=32), "no valid"),
        (lambda: evaluate(model, FixedMQAR([(torch.zeros(1, 8, dtype=torch.long),
                                                      torch.full((1, 8), IGNORE_INDEX))]), seq_len=8), "labelled"),
        (lambda: evaluate(model, ds, ["greedy"], seq_len=T), "unknown policy"),
        (lambda: evaluate(model, ds, seq_len=T, max_batches=0), "max_batches"),
        (lambda: evaluate(model, ds, ["matched"], seq_len=T), "matched_backbone"),
        (lambda: evaluate(model, ds, seq_len=T, lambdas=[-1.0]), "lambdas"),
        (lambda: evaluate(model, ds, seq_len=10_000), "seq_len"),
        (lambda: evaluate(make_model(use_workspace=False, vocab_size=256), ds, ["fixed"], seq_len=T),
         "no workspace"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="labelled"):
        greedy_oracle(model, x, torch.full_like(x, IGNORE_INDEX), torch.tensor([[1]]))


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_eval_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    """`prisme eval` on a saved checkpoint evaluates its training dataset (MQAR here) and writes JSON and PNG."""
    ckpt = save_checkpoint(tmp_path / "run" / "ckpt_000000", make_model().float(), TrainingState(
        stage="controller", step=0, stage_config=StageConfig(stage="controller", dataset="mqar").to_dict()))
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = cli.main(["eval", "--checkpoint", str(ckpt), "--batches", "1", "--batch-size", "2",
                   "--policies", "backbone,fixed,controller", "--lambdas", "0,0.1", "--device", "cpu",
                   "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["checkpoint"] == str(ckpt) and "controller(lambda=0.1)" in [r["policy"] for r in doc["rows"]]
    assert doc["dataset"].startswith("MQARDataset") and doc["rows"][0]["accuracy"] is not None
    assert out_png.stat().st_size > 0 and "fixed_4xk2" in capsys.readouterr().out
    rc = cli.main(["eval", "--checkpoint", str(ckpt), "--policies", "greedy", "--device", "cpu"])
    assert rc == 2 and "unknown policy" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------- paired
def test_every_row_carries_its_paired_difference_to_the_backbone_and_the_matched_backbone():
    """delta_vs_backbone (and, with a matched backbone, delta_vs_matched) = {mean, lo, hi, n_sequences, n_tokens}:
    the mean is loss minus the reference's loss on the same targets, the interval holds it, the verdict follows the
    interval; the matched row's own difference to itself is exactly zero."""
    model = make_model(vocab_size=256)
    matched = make_model(seed=5, vocab_size=256, use_workspace=False)
    report = evaluate(model, text_dataset(), batch_size=B, seq_len=T, max_batches=NB, oracle_positions=4,
                               matched_backbone=matched, seed=SEED, bootstrap_samples=200)
    base, mrow = report.row("backbone"), report.row("backbone+matched")
    for r in report.rows:
        d, m = r.delta_vs_backbone, r.delta_vs_matched
        assert set(d) == {"mean", "lo", "hi", "n_sequences", "n_tokens"} and set(m) == set(d)
        assert d["lo"] <= d["mean"] <= d["hi"] and m["lo"] <= m["mean"] <= m["hi"]
        assert abs(d["mean"] - (r.loss - r.baseline_loss)) < 1e-9
        assert r.verdict_vs_backbone == ("beats" if d["hi"] < 0 else "loses" if d["lo"] > 0 else "ties")
        if r.family != "oracle":
            assert d["n_sequences"] == NB * B and d["n_tokens"] == NB * B * T
            assert abs(m["mean"] - (r.loss - mrow.loss)) < 1e-9
    assert base.delta_vs_backbone["mean"] == base.delta_vs_backbone["hi"] == 0.0
    assert mrow.delta_vs_matched["lo"] == mrow.delta_vs_matched["hi"] == 0.0
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["rows"][1]["delta_vs_matched"] == mrow.delta_vs_matched and doc["n_sequences"] == NB * B
    assert "[" in report.table() and "vs matched" in report.table()


def test_equal_edits_baseline_spreads_the_controllers_mean_edits_uniformly():
    """Each controller row is followed by its equal-edits baseline: fixed single-slot edits thinned at random per
    position to the controller's mean edits per token (no controller cost), and the controller row carries the paired
    difference controller minus baseline."""
    from prisme.evaluation.policies import thinned_actions

    cfg = PrismeConfig.from_name("tiny")
    acts = thinned_actions(cfg, 1.3, cfg.r_max, (64, 50), torch.Generator().manual_seed(0))
    n = (acts != cfg.stop_action).sum(-1).double()
    assert set(n.unique().tolist()) == {1.0, 2.0} and abs(float(n.mean()) - 1.3) < 0.03
    assert torch.equal(thinned_actions(cfg, 2.0, 4, (3, 5), torch.Generator()), forced_actions(
        cfg, "fixed", 4, 1, (3, 5)).masked_fill(torch.arange(4) >= 2, cfg.stop_action))  # integer: exact
    model = make_model(vocab_size=256)
    report = evaluate(model, text_dataset(), ["controller"], batch_size=B, seq_len=T, max_batches=NB,
                               lambdas=[0.0, 0.3], seed=SEED, bootstrap_samples=100)
    rows = report.rows
    assert [r.family for r in rows] == ["controller", "equal_edits"] * 2
    for ctrl, eq in zip(rows[::2], rows[1::2]):
        assert eq.equal_edits_of == ctrl.policy and eq.controller_steps == 0.0
        assert abs(eq.mean_edits - ctrl.mean_edits) < 0.25  # the same budget, drawn per position
        d = ctrl.delta_vs_equal_edits
        assert abs(d["mean"] - (ctrl.loss - eq.loss)) < 1e-9 and d["lo"] <= d["mean"] <= d["hi"]


def test_cli_eval_scores_references_and_the_frontier_gap_against_them(tmp_path, capsys, monkeypatch):
    """`prisme eval --reference NAME=CKPT --frontier references --slices 4`: each reference is a row whose loss is its
    backbone alone on the same targets; with one frontier point every row's gap is its loss minus that point's (the
    nearest point beyond the ends), its own backbone included; bad names fail before any evaluation runs."""
    import prisme.evaluation.run as ev

    sc = StageConfig(stage="controller", dataset="austen", seq_len=32).to_dict()
    ckpt = save_checkpoint(tmp_path / "c" / "ckpt_000000", make_model(vocab_size=256).float(),
                           TrainingState(stage="controller", step=0, stage_config=sc))
    ref_model = make_model(seed=3, vocab_size=256, use_workspace=False).float()
    ref = save_checkpoint(tmp_path / "r" / "ckpt_000000", ref_model,
                          TrainingState(stage="backbone", step=0, stage_config=sc))
    out = tmp_path / "f.json"
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--reference", f"L1={ref}", "--frontier", "references",
                     "--slices", "4", "--batches", "2", "--batch-size", "4", "--policies", "backbone,fixed",
                     "--bootstrap", "50", "--json", str(out), "--routing-bound"]) == 0
    doc = json.loads(out.read_text())
    bound = doc["routing_bound"]
    assert bound["points"][0]["fraction"] == 0.0 and bound["points"][0]["gain"] == 0.0
    assert abs(bound["backbone_loss"] - {r["policy"]: r for r in doc["rows"]}["backbone"]["loss"]) < 1e-6
    rows = {r["policy"]: r for r in doc["rows"]}
    assert doc["references"] == {"L1": str(ref)} and rows["L1"]["family"] == "reference"
    assert rows["L1"]["frontier_gap"] is None  # a frontier point has no gap to itself
    for name in ("backbone", "fixed_1xk1", "fixed_2xk2"):
        assert abs(rows[name]["frontier_gap"]["mean"] - (rows[name]["loss"] - rows["L1"]["loss"])) < 1e-9
        assert set(rows[name]["slices"]) == {"ar_hit", "seen_miss", "other"}
    assert "minus the dense frontier" in capsys.readouterr().out
    monkeypatch.setattr(ev, "evaluate_policies", lambda *a, **k: pytest.fail("evaluation ran"))
    for bad, msg in ((["--reference", "L1"], "NAME=CHECKPOINT"), (["--reference", f"backbone={ref}"], "built-in"),
                     (["--reference", f"L1={ref}", "--frontier", "L2"], "known"), (["--frontier", "references"],
                                                                                    "does not have"),
                     (["--slices", "0"], "slices"), (["--routing-bound"], "--reference")):
        assert cli.main(["eval", "--checkpoint", str(ckpt), "--policies", "backbone", *bad]) == 2
        assert msg in capsys.readouterr().err, bad
    other = save_checkpoint(tmp_path / "o" / "ckpt_000000", make_model(vocab_size=64).float(),
                            TrainingState(stage="backbone", step=0, stage_config=sc))
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--reference", f"X={other}", "--policies", "backbone"]) == 2
    assert "vocabulary" in capsys.readouterr().err


def test_cli_batches_all_scores_the_whole_split_and_bad_batches_fail_before_any_model_runs(tmp_path, capsys,
                                                                                        monkeypatch):
    """--batches all covers every window of the validation split; 0, 'x' or more batches than the split holds are a
    one-line error (exit 2) before any evaluation runs; so are bad bootstrap settings."""
    import prisme.evaluation.run as ev

    model = make_model(vocab_size=256).float()
    sc = StageConfig(stage="controller", dataset="austen", seq_len=64).to_dict()
    ckpt = save_checkpoint(tmp_path / "c" / "ckpt_000000", model, TrainingState("controller", 0, stage_config=sc))
    out = tmp_path / "all.json"
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--batches", "all", "--batch-size", "64",
                     "--policies", "backbone", "--json", str(out)]) == 0
    from prisme.data.text import load_text

    n_windows = TokenDataset.from_text(load_text("austen"), ByteTokenizer(), val_fraction=0.1).n_eval_windows("val", 64)
    assert json.loads(out.read_text())["n_sequences"] == n_windows
    monkeypatch.setattr(ev, "evaluate_policies", lambda *a, **k: pytest.fail("evaluation ran"))
    for bad, msg in ((["--batches", "0"], "batches"), (["--batches", "x"], "batches"),
                     (["--batches", "100000"], "exceeds the split"), (["--bootstrap", "0"], "bootstrap"),
                     (["--bootstrap-seed", "-1"], "seed")):
        assert cli.main(["eval", "--checkpoint", str(ckpt), "--policies", "backbone", *bad]) == 2
        assert msg in capsys.readouterr().err


def test_cli_corpus_file_is_scored_whole_as_a_held_out_text(tmp_path, capsys):
    """--corpus FILE scores every window of the file (no 10% tail); the embedded held-out text works by name; an
    empty file or one shorter than a sequence is a clear error."""
    model = make_model(vocab_size=256).float()
    sc = StageConfig(stage="controller", dataset="austen", seq_len=16).to_dict()
    ckpt = save_checkpoint(tmp_path / "c" / "ckpt_000000", model, TrainingState("controller", 0, stage_config=sc))
    text = tmp_path / "held.txt"
    text.write_text("a fresh text that the model never saw " * 20)
    out = tmp_path / "h.json"
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--corpus", str(text), "--batches", "all",
                     "--policies", "backbone", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["n_sequences"] == (len(text.read_bytes()) - 1) // 16
    assert cli.main(["eval", "--checkpoint", str(ckpt), "--corpus", "devils_dictionary", "--batches", "2",
                     "--policies", "backbone"]) == 0
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("")
    short.write_text("tiny")
    for path, msg in ((empty, "empty"), (short, "fewer than one sequence")):
        capsys.readouterr()
        assert cli.main(["eval", "--checkpoint", str(ckpt), "--corpus", str(path), "--policies", "backbone"]) == 2
        assert msg in capsys.readouterr().err


def test_controller_budget_caps_the_controller_and_equal_edits_rows():
    """controller_budget (the budget stages 2 and 3 trained) bounds the controller's, the equal-edits and the
    oracle rows' steps; a budget outside [1, r_max] is a ValueError."""
    model = make_model(vocab_size=256)
    report = evaluate(model, text_dataset(), ["controller", "oracle"], batch_size=B, seq_len=T,
                               max_batches=1, lambdas=[0.0], seed=SEED, bootstrap_samples=50, controller_budget=2,
                               oracle_positions=2)
    assert all(r.budget == 2 and r.mean_edits <= 2 for r in report.rows)
    with pytest.raises(ValueError, match="controller_budget"):
        evaluate(model, text_dataset(), ["controller"], batch_size=B, seq_len=T, max_batches=1,
                          lambdas=[0.0], controller_budget=model.cfg.r_max + 1)


def test_cli_eval_controller_budget_and_kappa_reach_the_controller_rows(tmp_path):
    """--controller-budget and --kappa-risk set the controller rows' budget and risk aversion (a large kappa takes
    fewer edits); a negative kappa is a one-line error."""
    model = make_model(vocab_size=256).float()
    sc = StageConfig(stage="controller", dataset="austen", seq_len=16).to_dict()
    ckpt = save_checkpoint(tmp_path / "c" / "ckpt_000000", model, TrainingState("controller", 0, stage_config=sc))
    out = tmp_path / "e.json"
    base = ["eval", "--checkpoint", str(ckpt), "--batches", "1", "--policies", "controller", "--lambdas", "0"]
    assert cli.main([*base, "--controller-budget", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["budget"] == 1 and 0 < rows[0]["mean_edits"] <= 1
    assert cli.main([*base, "--json", str(out)]) == 0
    edits = json.loads(out.read_text())["rows"][0]["mean_edits"]
    assert cli.main([*base, "--kappa-risk", "1e9", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["mean_edits"] < edits  # risky actions are no longer taken
    assert cli.main([*base, "--kappa-risk", "-1"]) == 2


def test_a_shared_encoding_gives_the_same_outputs_bitwise():
    """`forward(x, actions, ctx=encode(x))` and `forward_policy(..., ctx=encode(x))` (what `evaluate_policies` does once
    per batch for every workspace row) equal the calls that encode themselves, bitwise. Negative control: another
    batch's encoding changes the logits."""
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny").replace(router=True)).eval()
    x, other = torch.randint(0, 64, (2, 2, 12)).unbind(0)
    acts = forced_actions(model.cfg, "fixed", 2, 1, x.shape, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ctx = model.encode(x)
        assert torch.equal(model(x, acts, ctx=ctx).logits, model(x, acts).logits)
        a, b = model.forward_policy(x, 2, lambda_cost=0.01, ctx=ctx), model.forward_policy(x, 2, lambda_cost=0.01)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.actions, b.actions)
        assert not torch.equal(model(x, acts, ctx=model.encode(other)).logits, model(x, acts).logits)



def test_lower_envelope_and_log_interpolation_weights():
    from prisme.stats import log_interpolation_weights, lower_envelope

    pts = [(1.0, 1.5), (1.0, 1.4), (2.0, 1.45), (4.0, 1.2), (8.0, 1.3)]  # (1, 1.5), (2, 1.45), (8, 1.3) dominated
    assert lower_envelope(pts) == [1, 3]
    assert log_interpolation_weights([1.0, 4.0], 2.0) == pytest.approx({0: 0.5, 1: 0.5})  # halfway in log ops
    assert log_interpolation_weights([1.0, 4.0], 0.5) == {0: 1.0}
    assert log_interpolation_weights([1.0, 4.0], 9.0) == {1: 1.0}
    with pytest.raises(ValueError):
        log_interpolation_weights([4.0, 1.0], 2.0)


def test_frontier_gap_is_the_loss_minus_the_frontier_interpolated_in_log_ops():
    """With the backbone (1x) and a deeper backbone (a reference at more ops) as the frontier, every workspace row's
    frontier gap is its loss minus the frontier's loss interpolated linearly in log ops at the row's ops, with an
    interval holding the mean; the frontier rows get none, nor does the oracle (its own sampled positions).
    Negative control: interpolating linearly in ops (not log ops) gives another number."""
    import math

    model = make_model(vocab_size=256)
    deeper = make_model(seed=5, vocab_size=256, use_workspace=False, n_layer=12)  # its loss must be below the
    with torch.no_grad():  # backbone's to be on the frontier: the backbone, ten layers that add nothing, softer logits
        own = dict(model.backbone.named_parameters())
        for name, p in deeper.backbone.named_parameters():
            p.copy_(own[name] if name in own else torch.zeros_like(p) if name.endswith(("wo.weight", "w2.weight"))
                    else p)
        deeper.backbone.norm.weight.mul_(0.5)
    report = evaluate(model, text_dataset(), ["backbone", "fixed", "controller", "oracle"], batch_size=B,
                               seq_len=T, max_batches=NB, oracle_positions=4, seed=SEED, bootstrap_samples=200,
                               references={"deeper": deeper}, budgets=[1, 2], frontier=["backbone", "deeper"])
    base, deep = report.row("backbone"), report.row("deeper")
    assert report.frontier == ["backbone", "deeper"] and deep.relative_ops > 2
    gapped = [r for r in report.rows if r.frontier_gap]
    assert {r.family for r in gapped} >= {"fixed", "controller"} and "oracle" not in {r.family for r in gapped}
    for r in gapped:
        x = min(max(r.relative_ops, 1.0), deep.relative_ops)
        a = math.log(x) / math.log(deep.relative_ops)
        want = r.loss - ((1 - a) * base.loss + a * deep.loss)
        g = r.frontier_gap
        assert abs(g["mean"] - want) < 1e-9 and g["lo"] <= g["mean"] <= g["hi"], r.policy
        assert r.verdict_vs_frontier == ("beats" if g["hi"] < 0 else "loses" if g["lo"] > 0 else "ties")
        if 1.0 < r.relative_ops < deep.relative_ops:
            a_lin = (r.relative_ops - 1) / (deep.relative_ops - 1)
            assert abs(r.loss - ((1 - a_lin) * base.loss + a_lin * deep.loss) - g["mean"]) > 1e-6
    assert any(1.0 < r.relative_ops < deep.relative_ops for r in gapped)  # the negative control ran
    assert "dense frontier" in report.table()
    with pytest.raises(ValueError, match="frontier rows"):
        evaluate(model, text_dataset(), ["backbone"], batch_size=B, seq_len=T, max_batches=1,
                          frontier=["nope"])


def _slices_by_hand(x: list[int], y: list[int], n: int) -> list[int]:
    out = []
    for t in range(len(x)):
        if y[t] == IGNORE_INDEX:
            out.append(-1)
            continue
        gram = x[t - n + 1:t + 1] if t >= n - 1 else None
        seen = [j for j in range(n - 1, t) if gram is not None and x[j - n + 1:j + 1] == gram]
        out.append(0 if any(x[j + 1] == y[t] for j in seen) else 1 if seen else 2)
    return out


@pytest.mark.parametrize("vocab", [3, 2**20])  # the second compares the n tokens themselves (no exact packing)
def test_ar_slice_labels_equal_a_plain_search(vocab):
    """AR hit (the n-gram ending at t occurred earlier and was followed there by t's target), seen miss, other, and
    -1 without a target, against a by-hand search. Negative control: letting j reach t (a position's own n-gram
    counted as earlier) changes the labels."""
    from prisme.evaluation.slices import ar_slice_labels

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (4, 40), generator=g) * (vocab // 3)
    y = torch.cat([x[:, 1:], torch.randint(0, 3, (4, 1), generator=g) * (vocab // 3)], 1)
    y[0, 5] = IGNORE_INDEX
    for n in (1, 2, 3):
        got = ar_slice_labels(x, y, n)
        for b in range(4):
            assert got[b].tolist() == _slices_by_hand(x[b].tolist(), y[b].tolist(), n)
        assert set(got.flatten().tolist()) >= {0, 1, -1}
    sloppy = [0 if any(x[0, j + 1] == y[0, t] for j in range(1, t + 1) if j + 1 < 40 and x[0, j] == x[0, t])
              else 2 for t in range(39)]
    assert sloppy != [v if v != 1 else 2 for v in ar_slice_labels(x, y, 1)[0, :39].tolist()]
    with pytest.raises(ValueError, match="n-gram length"):
        ar_slice_labels(x, y, 0)


def _window_slices_by_hand(x: list[int], y: list[int], n: int, W: int, sloppy: bool = False) -> list[int]:
    """`ar_slice_labels(..., window=W)` by a plain search: a hit within the window when an earlier occurrence followed
    by the target has its whole n-gram inside positions t - W + 1 .. t (`sloppy`: only its continuation)."""
    out = []
    for t, v in enumerate(_slices_by_hand(x, y, n)):
        if v != 0:
            out.append(v if v < 0 else v + 1)
            continue
        gram = x[t - n + 1:t + 1]
        near = [j for j in range(n - 1, t)
                if x[j - n + 1:j + 1] == gram and x[j + 1] == y[t] and (j + 1 if sloppy else j - n + 1) >= t - W + 1]
        out.append(0 if near else 1)
    return out


@pytest.mark.parametrize("n, W", [(1, 4), (2, 6), (3, 12)])
def test_window_slices_split_the_ar_hits_by_where_their_occurrence_lies(n, W):
    """With a window, an AR hit is "in the window" when some earlier occurrence followed by the target lies whole in
    t - W + 1 .. t, else "beyond"; seen misses and others keep their labels; against a plain search. Negative control:
    a window one position wider labels some hits differently."""
    from prisme.evaluation.slices import WINDOW_SLICES, ar_slice_labels, slice_names

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (8, 64), generator=g)
    y = torch.cat([x[:, 1:], torch.randint(0, 4, (8, 1), generator=g)], 1)
    got = ar_slice_labels(x, y, n, window=W)
    for b in range(8):
        assert got[b].tolist() == _window_slices_by_hand(x[b].tolist(), y[b].tolist(), n, W)
    assert set(got.flatten().tolist()) >= {0, 1, 2} and slice_names(W) == WINDOW_SLICES
    plain = ar_slice_labels(x, y, n)
    assert torch.equal((got <= 1) & (got >= 0), plain == 0)  # the hits, split; nothing else moves
    assert any(got[b].tolist() != _window_slices_by_hand(x[b].tolist(), y[b].tolist(), n, W, sloppy=True)
               for b in range(8))  # only the continuation inside the window: a local model could not copy those
    with pytest.raises(ValueError, match="window"):
        ar_slice_labels(x, y, n, window=0)


def test_every_row_reports_its_slices_and_they_add_up(run):
    """With `slices=2`: per slice the loss, its gain over the backbone and that gain's share, and edits per
    position; the slices' target shares sum to 1, their losses weighted by those shares give the row's loss, their
    gain shares sum to 1 (rows that differ from the backbone), and a fixed 1 x k1 row edits once at every position."""
    model, ds, _ = run
    report = evaluate(model, ds, ["backbone", "fixed", "controller"], batch_size=B, seq_len=T,
                               max_batches=NB, seed=SEED, budgets=[1], ks=[1], slices=2, bootstrap_samples=50)
    for r in report.rows:
        sl = r.slices
        assert set(sl) == {"ar_hit", "seen_miss", "other"}
        assert abs(sum(v["share_of_targets"] for v in sl.values()) - 1) < 1e-12
        assert abs(sum(v["share_of_targets"] * v["loss"] for v in sl.values() if v["loss"] is not None)
                   - r.loss) < 1e-9
        if r.family != "backbone" and abs(r.loss - r.baseline_loss) > 1e-9:
            assert abs(sum(v["share_of_gain"] for v in sl.values() if v["share_of_gain"] is not None) - 1) < 1e-9
    fixed = report.row("fixed_1xk1")
    assert all(v["edits_per_position"] == 1.0 for v in fixed.slices.values() if v["loss"] is not None)
    assert report.row("backbone").slices["ar_hit"]["edits_per_position"] is None
