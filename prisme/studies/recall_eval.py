"""The recall study's evaluation of one run: the backbone, forced rows, the controller at each price,
the oracle, diagnostics, and whether a seed passes its bars."""

from __future__ import annotations

import math
from typing import Any

import torch

from prisme.costs.traces import trace_cost
from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.evaluation.policies import forced_actions
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
    """`n` sequences from the generator seeded `seed`, in chunks of CHUNK: (x, y) `[b, T]`."""
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < n:
        b = min(CHUNK, n - done)
        yield make_mqar_batch(mcfg, b, g)
        done += b


def _queries(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows `[b, 1]`, query positions `[b, Q]`) of an MQAR batch (every row has the same number of queries)."""
    lab = y != IGNORE_INDEX
    Q = int(lab.sum(1).max())
    pos = torch.argsort((~lab).to(torch.int8), dim=1, stable=True)[:, :Q]
    return torch.arange(y.shape[0]).unsqueeze(1), pos


@torch.no_grad()
def evaluate_backbone(model: torch.nn.Module, mcfg: MQARConfig, data_seed: int, n_seq: int) -> float:
    """Query accuracy of the backbone alone on `n_seq` sequences drawn from `data_seed`."""
    hit = n = 0
    for x, y in _batches(mcfg, n_seq, data_seed):
        lab = y != IGNORE_INDEX
        pred = model(x).logits.argmax(-1)
        hit += int((pred[lab] == y[lab]).sum())
        n += int(lab.sum())
    return hit / n


def forced_row(model, mcfg, data_seed, n_seq, name, family, n, k) -> dict[str, Any]:
    """A forced policy: accuracy at the query positions; ops and edits over every position of its trace."""
    cfg = model.cfg
    T = mcfg.seq_len
    g = torch.Generator().manual_seed(RANDOM_POLICY_SEED + data_seed)
    hit = tot = 0
    for x, y in _batches(mcfg, n_seq, data_seed):
        rows, pos = _queries(y)
        st = model.streams(x)
        ctx = model.context_from_H(st, st.index(rows, pos), query_pos=pos)
        acts = forced_actions(cfg, family, n, k, pos.shape, g)  # [b, Q, n]
        roll = model.rollout_forced(ctx, acts)
        logits, _ = model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
        yq = y[rows, pos]
        hit += int((logits.argmax(-1) == yq).sum())
        tot += yq.numel()
    trace = forced_actions(cfg, family, n, k, (1, T), torch.Generator().manual_seed(0))  # every position alike
    ops = trace_cost(cfg, trace, torch.arange(1, T + 1), optimised=cfg.optimised)
    return {"policy": name, "family": family, "accuracy": hit / tot, "ops_ratio": ops.relative,
            "ops_per_token": ops.ops_per_token, "edits_per_token": float(n)}


def policy_rows(model, mcfg, data_seed, n_seq, lambdas, budget: int | None = None) -> list[dict[str, Any]]:
    """The deployed policy (the controller; with `cfg.router`, the router first) at each price in `lambdas`, with
    `budget` steps (default r_max): every position decides; accuracy at the queries, ops and edits over all
    positions. Each batch is encoded once and rolled out at every price (what `forward_policy` does per call)."""
    cfg = model.cfg
    budget = cfg.r_max if budget is None else budget
    T = mcfg.seq_len
    acc = [{"hit": 0, "tot": 0, "edits": 0.0, "edits_q": 0.0, "acts": [], "steps": []} for _ in lambdas]
    for x, y in _batches(mcfg, n_seq, data_seed):
        ctx = model.encode(x)
        lab = y != IGNORE_INDEX
        for a, lam in zip(acc, lambdas):
            roll = model.rollout_policy(ctx, budget, model.action_cost, lambda_cost=lam)
            logits, _ = model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
            a["hit"] += int((logits.argmax(-1)[lab] == y[lab]).sum())
            a["tot"] += int(lab.sum())
            a["edits"] += float(roll.n_edits.sum())
            a["edits_q"] += float(roll.n_edits[lab].sum())
            a["acts"].append(roll.actions.reshape(-1, roll.actions.shape[-1]))
            a["steps"].append(roll.controller_steps.reshape(-1))
    contexts = torch.arange(1, T + 1).repeat(n_seq)
    rows = []
    for a, lam in zip(acc, lambdas):
        ops = trace_cost(cfg, torch.cat(a["acts"]), contexts, torch.cat(a["steps"]), optimised=cfg.optimised,
                         router=cfg.router)
        rows.append({"lambda": float(lam), "accuracy": a["hit"] / a["tot"], "ops_ratio": ops.relative,
                     "ops_per_token": ops.ops_per_token,
                     "edits_per_token": a["edits"] / (n_seq * T),
                     "query_edit_share": a["edits_q"] / a["edits"] if a["edits"] else 0.0})
    return rows


def _oracle_row(model, mcfg, seed, n_seq) -> dict[str, Any]:
    """The greedy oracle at lambda 0 at the query positions (it reads the targets, so it knows where they are and
    stops at once everywhere else); its trace is charged as if a controller had chosen it."""
    from prisme.evaluation.oracle import greedy_oracle

    cfg = model.cfg
    T = mcfg.seq_len
    hit = tot = 0
    edits = 0.0
    acts, steps, ctxs = [], [], []
    for x, y in _batches(mcfg, n_seq, EVAL_SEED + seed):
        rows, pos = _queries(y)
        res = greedy_oracle(model, x, y, pos, cfg.r_max, 0.0)
        yq = y[rows, pos]
        hit += int((res.logits.argmax(-1) == yq).sum())
        tot += yq.numel()
        edits += float(res.n_edits.sum())
        full = torch.full((x.shape[0], T, cfg.r_max), cfg.stop_action)
        full[rows, pos] = res.actions
        n_full = torch.zeros(x.shape[0], T, dtype=torch.long)
        n_full[rows, pos] = res.n_edits
        acts.append(full.reshape(-1, cfg.r_max))
        steps.append(torch.clamp(n_full + 1, max=cfg.r_max).reshape(-1))
        ctxs.append(torch.arange(1, T + 1).repeat(x.shape[0]))
    ops = trace_cost(cfg, torch.cat(acts), torch.cat(ctxs), torch.cat(steps), optimised=cfg.optimised)
    return {"policy": "oracle(lambda=0)", "family": "oracle", "accuracy": hit / tot, "ops_ratio": ops.relative,
            "edits_per_token": edits / (n_seq * T), "deployable": False}


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
    fixed = [{"policy": "backbone", "family": "backbone", "accuracy": evaluate_backbone(model, mcfg, data, n_eval),
              "ops_ratio": 1.0, "edits_per_token": 0.0}]
    fixed += [forced_row(model, mcfg, data, n_eval, f"fixed_{n}xk{k}", "fixed", n, k) for k in (1, 2) for n in ns]
    fixed += [forced_row(model, mcfg, data, n_eval, f"random_{n}xk1", "random", n, 1) for n in ns[:2]]
    fixed += [forced_row(model, mcfg, data, n_eval, "dense_1", "dense", 1, mc.n_slots)]
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
    ws_rows = [r for r in entry["fixed"] if r["family"] != "backbone"]
    passing = [r for r in ws_rows if r["accuracy"] >= TARGET_ACCURACY]
    cheapest = min((r["ops_ratio"] for r in passing), default=math.inf)
    dominated = any(r["ops_ratio"] < c["ops_ratio"] and r["accuracy"] > c["accuracy"] for r in entry["fixed"])
    return {"workspace": entry["budget1_accuracy"] >= TARGET_ACCURACY,
            "controller": bool(c["accuracy"] >= TARGET_ACCURACY and c["edits_per_token"] <= 0.3
                               and c["query_edit_share"] >= 0.8 and c["ops_ratio"] < cheapest and not dominated)}
