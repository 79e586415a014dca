"""The recall study's evaluation of one run: the backbone, forced rows, the controller at each price,
the oracle, diagnostics, and whether a seed passes its bars."""

from __future__ import annotations

import math
from typing import Any

import torch

from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.evaluation.policies import FORCED, ROW_KINDS, BackboneRows, ControllerRows, OracleRows, Policy
from prisme.evaluation.report import EvalReport, EvalRow
from prisme.evaluation.run import EvalOptions, QueryAccuracy, evaluate_policies
from prisme.studies.recall_setup import (
    CALIBRATION_SEED,
    CHUNK,
    EVAL_SEED,
    RANDOM_POLICY_SEED,
    TARGET_ACCURACY,
    RecallStudyConfig,
)


# ------------------------------------------------------------------------------------------------------- evaluation
def _batches(mcfg: MQARConfig, n: int, seed: int):
    """`n` sequences from the generator seeded `seed`, in chunks of CHUNK (at T = 32; as many tokens at longer T):
    (x, y) `[b, T]`."""
    g = torch.Generator().manual_seed(seed)
    chunk = max(1, CHUNK * 32 // max(mcfg.seq_len, 32))
    done = 0
    while done < n:
        b = min(chunk, n - done)
        yield make_mqar_batch(mcfg, b, g)
        done += b


def score(model: torch.nn.Module, mcfg: MQARConfig, data_seed: int, n_seq: int, policies: list[Policy]
          ) -> EvalReport:
    """`policies` on `n_seq` sequences drawn from `data_seed`, scored at the query positions (forced edits run there
    only; the controller decides at every position), the random rows drawing from RANDOM_POLICY_SEED + data_seed."""
    opts = EvalOptions(seed=RANDOM_POLICY_SEED + data_seed, scorer=QueryAccuracy(), bootstrap_samples=1)
    return evaluate_policies(model, list(_batches(mcfg, n_seq, data_seed)), policies, opts)


def policy_row(row: EvalRow) -> dict[str, Any]:
    """A row in the study's JSON vocabulary (`recall.json`): accuracy, `ops_ratio` (the row's relative ops), edits
    per token over every position."""
    out = {"policy": row.policy, "family": row.family, "accuracy": row.accuracy, "ops_ratio": row.relative_ops,
           "ops_per_token": row.ops_per_token, "edits_per_token": row.mean_edits}
    if not row.deployable:
        del out["ops_per_token"]
        out["deployable"] = False
    return out


def price_row(row: EvalRow) -> dict[str, Any]:
    """A controller row at one price in the study's vocabulary, with the share of its edits on query positions."""
    return {"lambda": row.lambda_cost, "accuracy": row.accuracy, "ops_ratio": row.relative_ops,
            "ops_per_token": row.ops_per_token, "edits_per_token": row.mean_edits,
            "query_edit_share": row.scored_edit_share or 0.0}


@torch.no_grad()
def evaluate_backbone(model: torch.nn.Module, mcfg: MQARConfig, data_seed: int, n_seq: int) -> float:
    """Query accuracy of the backbone alone on `n_seq` sequences drawn from `data_seed`."""
    return score(model, mcfg, data_seed, n_seq, [BackboneRows()]).rows[0].accuracy


def forced_row(model, mcfg, data_seed, n_seq, name, family, n, k) -> dict[str, Any]:
    """One forced policy (`family` of `FORCED`, n actions of k slots): accuracy at the query positions; ops and edits
    over every position of its trace."""
    return policy_row(score(model, mcfg, data_seed, n_seq, [FORCED[family]([n], (k,))]).rows[0]) | {"policy": name}


def policy_rows(model, mcfg, data_seed, n_seq, lambdas, budget: int | None = None) -> list[dict[str, Any]]:
    """The deployed policy (the controller; with `cfg.router`, the router first) at each price in `lambdas`, with
    `budget` steps (default r_max): every position decides; accuracy at the queries, ops and edits over all
    positions. Each batch is encoded once and rolled out at every price."""
    policy = ControllerRows([float(v) for v in lambdas], budget, equal_edits=False)
    return [price_row(r) for r in score(model, mcfg, data_seed, n_seq, [policy]).rows]


def _oracle_row(model, mcfg, seed, n_seq) -> dict[str, Any]:
    """The greedy oracle at lambda 0 at the query positions (it reads the targets, so it knows where they are and
    stops at once everywhere else); its trace is charged as if a controller had chosen it."""
    oracle = OracleRows([0.0], positions=None, every_position=True)
    return policy_row(score(model, mcfg, EVAL_SEED + seed, n_seq, [oracle]).rows[0])


@torch.no_grad()
def diagnostics(model: torch.nn.Module, mcfg: MQARConfig, seed: int, n_seq: int = 256) -> dict[str, float]:
    """Budget-1 policy (slot 0 at every position), first edit, editor block 0: the cross-attention mass on the queried
    pair's value (mean over heads and query positions), the gate at query and at other positions, and
    |delta| / |H| at query positions."""
    x, y = make_mqar_batch(mcfg, n_seq, torch.Generator().manual_seed(EVAL_SEED + seed))
    lab = y != IGNORE_INDEX
    B, T = x.shape
    out = model(x, torch.zeros(B, T, 1, dtype=torch.long), return_state=True)
    ctx, blk = out.ctx, model.editor.blocks[0]
    step = torch.zeros(B, T, dtype=torch.long)
    att = blk.bank_attention(ctx.S0[:, :, 0], step, step, ctx.K, ctx.bank_mask)  # [B, nh, T, Tb]
    b, t = lab.nonzero(as_tuple=True)
    keys = x[:, 0:2 * mcfg.n_pairs:2]  # [B, N] the pairs' keys
    j = (keys[b] == x[b, t].unsqueeze(1)).float().argmax(1)  # which pair each query asks for
    xattn = att[b, :, t, 2 * j + 1].mean()
    gate = out.infos[0].gates[0][0].view(B, T)  # block 0, singles: every position, in (b, t) order
    delta = out.delta.norm(dim=-1) / ctx.H.norm(dim=-1).clamp(min=1e-12)
    return {"xattn_correct_value": float(xattn), "gate_query": float(gate[lab].mean()),
            "gate_other": float(gate[~lab].mean()), "delta_over_H": float(delta[lab].mean())}


@torch.no_grad()
def evaluate_run(model: torch.nn.Module, mcfg: MQARConfig, seed: int, cfg: RecallStudyConfig) -> dict[str, Any]:
    """One trained workspace model: every policy's row, the controller at its calibrated lambda, diagnostics."""
    mc = model.cfg
    n_eval, data = cfg.eval_sequences, EVAL_SEED + seed
    ns = [n for n in (1, 2, 4) if n <= mc.r_max]
    rep = score(model, mcfg, data, n_eval, [BackboneRows(), FORCED["fixed"](ns, (1, 2)), FORCED["random"](ns[:2], (1,)),
                                            FORCED["dense"]([1])])
    fixed = [policy_row(r) for r in rep.rows]
    fixed[0] = {"policy": "backbone", "family": "backbone", "accuracy": rep.rows[0].accuracy, "ops_ratio": 1.0,
                "edits_per_token": 0.0}
    controllers, controller = calibrated_policy(model, mcfg, seed, cfg, cfg.lambdas)
    oracle = _oracle_row(model, mcfg, seed, min(n_eval, 512))
    entry = {"seed": seed, "budget1_accuracy": next(r for r in fixed if r["policy"] == "fixed_1xk1")["accuracy"],
             **diagnostics(model, mcfg, seed), "fixed": fixed, "controller": controller, "controllers": controllers,
             "oracle": oracle, "bank_source": mc.bank_source, "query_source": mc.query_source,
             "bank_shift": mc.bank_shift}
    entry["success"] = seed_success(entry)
    return entry


def calibrated_policy(model, mcfg: MQARConfig, seed: int, cfg: RecallStudyConfig, lambdas,
                      budget: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The deployed policy at every price of `lambdas` on the held-out sequences, and its row at the price chosen on
    the separate calibration set: the cheapest whose calibration accuracy is within `accuracy_tolerance` of the
    budget-1 policy's (the most accurate where none is)."""
    lambdas = sorted({float(v) for v in lambdas})
    calib = policy_rows(model, mcfg, CALIBRATION_SEED + seed, cfg.calibration_sequences, lambdas, budget)
    budget1_calib = forced_row(model, mcfg, CALIBRATION_SEED + seed, cfg.calibration_sequences, "fixed_1xk1",
                                "fixed", 1, 1)["accuracy"]
    ok = [r for r in calib if r["accuracy"] >= budget1_calib - cfg.accuracy_tolerance]
    best = min(ok, key=lambda r: r["ops_ratio"]) if ok else max(calib, key=lambda r: r["accuracy"])
    rows = policy_rows(model, mcfg, EVAL_SEED + seed, cfg.eval_sequences, lambdas, budget)
    chosen = dict(next(r for r in rows if r["lambda"] == best["lambda"]))
    chosen["calibration_accuracy"] = best["accuracy"]
    chosen["calibration_budget1_accuracy"] = budget1_calib
    return rows, chosen


def seed_success(entry: dict[str, Any]) -> dict[str, bool]:
    """The issue's bars for one run: the workspace at budget 1, and the controller against every fixed row."""
    c = entry["controller"]
    ws_rows = [r for r in entry["fixed"] if ROW_KINDS[r["family"]].workspace]
    passing = [r for r in ws_rows if r["accuracy"] >= TARGET_ACCURACY]
    cheapest = min((r["ops_ratio"] for r in passing), default=math.inf)
    dominated = any(r["ops_ratio"] < c["ops_ratio"] and r["accuracy"] > c["accuracy"] for r in entry["fixed"])
    return {"workspace": entry["budget1_accuracy"] >= TARGET_ACCURACY,
            "controller": bool(c["accuracy"] >= TARGET_ACCURACY and c["edits_per_token"] <= 0.3
                               and c["query_edit_share"] >= 0.8 and c["ops_ratio"] < cheapest and not dominated)}
