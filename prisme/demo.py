"""`prisme demo` (`make demo`): the recall study, then the whole pipeline on the embedded Austen corpus, in minutes on
a laptop CPU.

0. recall        `prisme study recall` on a few seeds (MQAR: where the workspace solves what its backbone cannot)
1. backbone      stage 1 on byte-level Austen (the `demo` preset)
2. workspace     stage 2 from stage 1's checkpoint (backbone frozen, random forced actions)
3. matched       the stage-1 backbone trained further on as many tokens as stage 2 used (the fair baseline)
4. controller    stage 3 from stage 2's checkpoint (value/risk regressed on the oracle's true loss drops)
5. evaluate      every policy's validation loss vs measured ops per token: table, eval.json, pareto.png
6. sample        a short greedy continuation with the controller

Everything lands in one run folder (printed at the end): one sub-folder per stage (checkpoints, metrics.jsonl),
eval.json, pareto.png, sample.txt and summary.json (wall time per phase, the stage results, the verdict).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_model, write_text_atomic
from .config import PrismeConfig
from .data import ByteTokenizer, TokenDataset, load_text
from .train import StageConfig, TrainResult, train_stage

PROMPT = "It is a truth universally acknowledged, that"


def demo_stage_configs(run: Path, scale: float = 1.0, seed: int = 1337, backbone_keeps_learning: bool = False,
                       seq_len: int = 128) -> dict[str, StageConfig]:
    """The demo's four runs (configs/demo_*.json hold the same settings for `prisme train`).

    `scale` multiplies every step count (0.05 makes a smoke run). The matched run's steps are set so that it sees
    as many tokens as the workspace stage.
    """

    def steps(n: int) -> int:
        return max(2, round(n * scale))

    common = dict(batch_size=16, seq_len=seq_len, seed=seed, dataset="austen", eval_batches=4, keep_last=1,
                  log_every=10)
    s1 = StageConfig(stage="backbone", steps=steps(3600), lr=3e-3, min_lr=3e-4, warmup=steps(40),
                     eval_every=steps(1200),
                     out_dir=str(run / "1_backbone"), **common)
    s2 = StageConfig(stage="workspace", steps=steps(240), lr=1e-3, min_lr=3e-4, warmup=steps(20),
                     eval_every=steps(120), out_dir=str(run / "2_workspace"), init_from=s1.out_dir,
                     p_dense=0.05, deep_supervision=0.5, **common)
    if backbone_keeps_learning:  # the backbone takes exactly the matched baseline's steps; the workspace rides on it
        s2 = s2.replace(train_backbone_in_workspace_stage=True, workspace_grad_to_backbone=False, backbone_lr=1e-3,
                        backbone_min_lr=3e-4)
    tokens_ws = s2.steps * s2.batch_size * s2.seq_len
    s_matched = StageConfig(stage="backbone", steps=max(2, math.ceil(tokens_ws / (16 * seq_len))), lr=1e-3, min_lr=3e-4,
                            warmup=steps(20), eval_every=0, out_dir=str(run / "3_backbone_matched"),
                            init_from=s1.out_dir, **common)
    s3 = StageConfig(stage="controller", steps=steps(150), lr=3e-3, min_lr=3e-4, warmup=steps(15),
                     eval_every=steps(75), out_dir=str(run / "4_controller"), init_from=s2.out_dir,
                     oracle_positions=16, **{**common, "batch_size": 8})
    return {"backbone": s1, "workspace": s2, "matched": s_matched, "controller": s3}


def _sample(model: torch.nn.Module, prompt: str, n_tokens: int, max_budget: int) -> tuple[str, dict[str, Any]]:
    """Greedy continuation with the controller (prisme.generate if present, else a plain forward loop)."""
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    try:
        from .generate import generate
    except ImportError:  # pragma: no cover - the decoding module is optional for the demo
        generate = None
    if generate is not None:
        out = generate(model, [ids], n_tokens, max_budget=max_budget)
        return tok.decode(out.tokens[0]), {"relative_cost": out.relative_cost, "lambda_cost": out.lambda_cost,
                                           "mean_edits": sum(out.n_edits[0]) / max(1, len(out.n_edits[0]))}
    x = torch.tensor([ids])
    with torch.no_grad():  # pragma: no cover
        for _ in range(n_tokens):
            logits = model.forward_policy(x[:, -model.cfg.max_seq_len:], max_budget).logits[:, -1]
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    return tok.decode(x[0, len(ids):].tolist()), {}


def _stage_summary(r: TrainResult, wall: float) -> dict[str, Any]:
    return {"steps": r.step, "tokens": r.tokens, "wall_s": round(wall, 1), "checkpoint": str(r.checkpoint),
            "train": r.train, "val": r.val}


def run_demo(out: str | Path | None = None, scale: float = 1.0, threads: int | None = None, seed: int = 1337,
             backbone_keeps_learning: bool = False, eval_batches: int = 16, progress: bool = True,
             model_cfg: PrismeConfig | None = None, recall_seeds: list[int] | None = None) -> dict[str, Any]:
    """Run the demo end to end; returns the summary (also written to <run>/summary.json).

    `model_cfg` replaces the `demo` preset (tests run the same pipeline on a byte-level `tiny`). `recall_seeds`: the
    recall study's seeds (None or [] skips it; with `scale` < 1 it runs in its quick mode).
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if isinstance(eval_batches, bool) or not isinstance(eval_batches, int) or eval_batches < 1:
        raise ValueError(f"eval_batches must be an int >= 1, got {eval_batches!r}")  # before minutes of training
    if threads is not None and threads > 0:
        torch.set_num_threads(threads)
    run = Path(out) if out is not None else Path("runs") / f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if run.exists() and any(run.iterdir()):
        raise ValueError(f"run folder {run} already exists and is not empty; pass another --out")
    cfg = model_cfg if model_cfg is not None else PrismeConfig.from_name("demo")
    if cfg.vocab_size < 256 or not cfg.use_workspace:
        raise ValueError(f"the demo needs a byte-level model (vocab_size >= 256) with a workspace, got {cfg.name!r}")
    stages = demo_stage_configs(run, scale, seed, backbone_keeps_learning, seq_len=min(128, cfg.max_seq_len))
    if not progress:
        stages = {k: v.replace(progress=False) for k, v in stages.items()}
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    walls: dict[str, float] = {}
    recall = None
    if recall_seeds:
        from .study_recall import format_table, run_study, study_config

        rcfg = study_config({"seeds": list(recall_seeds), "out_dir": str(run / "recall"), "quick": scale < 1})
        print(f"demo: the recall study (seeds {','.join(map(str, rcfg.seeds))}) in {run / 'recall'}")
        doc = run_study(rcfg, progress=progress)
        print(format_table(doc) + "\n")
        recall = {"summary": doc["summary"], "controls": {k: v["accuracy"] for k, v in doc["controls"].items()},
                  "json": str(run / "recall" / "recall.json"), "wall_s": round(doc["wall_s"]["total"], 1)}
        walls["recall"] = time.perf_counter() - t0
    t_data = time.perf_counter()
    data = TokenDataset.from_text(load_text("austen"), ByteTokenizer(), val_fraction=0.1)
    walls["data"] = time.perf_counter() - t_data
    print(f"demo: {cfg.name} preset ({sum(model_params(cfg).values()):,} parameters), {data}, run folder {run}")
    results: dict[str, TrainResult] = {}
    for name in ("backbone", "workspace", "matched", "controller"):
        t = time.perf_counter()
        results[name] = train_stage(cfg if name == "backbone" and stages[name].init_from is None else None,
                                    stages[name], dataset=data)
        walls[name] = time.perf_counter() - t
        r = results[name]
        shown = {k: round(v, 4) for k, v in r.val.items() if k in ("loss", "loss_backbone", "gain", "value_mse",
                                                                    "value_mse_const", "value_r2", "top1_agree")}
        print(f"  {name:<11} {r.step:>5} steps  {r.tokens:>9,} tokens  {walls[name]:6.1f} s  val {shown}")
        if r.interrupted:
            raise KeyboardInterrupt

    from .evaluate import evaluate_policies

    t = time.perf_counter()
    model, _ = load_model(stages["controller"].out_dir)
    matched, _ = load_model(stages["matched"].out_dir)
    report = evaluate_policies(model, data, batch_size=8, seq_len=stages["workspace"].seq_len,
                               max_batches=eval_batches, matched_backbone=matched, oracle_positions=8,
                               seed=seed, progress=progress)
    walls["evaluate"] = time.perf_counter() - t
    print(report.table())
    doc = report.to_json()
    write_text_atomic(run / "eval.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
    report.plot(run / "pareto.png")

    t = time.perf_counter()
    n_new = stages["workspace"].seq_len - len(ByteTokenizer().encode(PROMPT))  # stay within the trained positions
    text, info = _sample(model, PROMPT, n_new, model.cfg.r_max)
    walls["sample"] = time.perf_counter() - t
    write_text_atomic(run / "sample.txt", PROMPT + text + "\n")
    print(f"\nsample (greedy, controller budget {model.cfg.r_max}):\n{PROMPT}{text}\n")

    verdict = compare_to_matched(report.rows)
    walls["total"] = time.perf_counter() - t0
    summary = {"run": str(run), "preset": cfg.to_dict(), "wall_s": {k: round(v, 1) for k, v in walls.items()},
               "threads": torch.get_num_threads(), "stages": {k: _stage_summary(results[k], walls[k])
                                                              for k in results},
               "stage_configs": {k: v.to_dict() for k, v in stages.items()}, "verdict": verdict,
               "sample": {"prompt": PROMPT, "text": text, **info}, "recall": recall}
    write_text_atomic(run / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    print(verdict["text"])
    print(f"wall time {walls['total']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in walls.items() if k != 'total')})")
    print(f"run folder: {run}  (eval.json, pareto.png, sample.txt, summary.json, one folder per stage)")
    return summary


def model_params(cfg: PrismeConfig) -> dict[str, int]:
    from .model import PrismeModel

    with torch.device("meta"):
        return PrismeModel(cfg).num_parameters()


def compare_to_matched(rows: list) -> dict[str, Any]:
    """Does any deployable workspace policy beat the backbone trained on matched extra tokens, and at what ops?"""
    by = {r.policy: r for r in rows}
    base, matched = by.get("backbone"), next((r for r in rows if r.family == "matched"), None)
    ws = [r for r in rows if r.deployable and r.family not in ("backbone", "matched")]
    if base is None or matched is None or not ws:
        return {"text": "verdict: not enough rows to compare", "beats_matched": None}
    best = min(ws, key=lambda r: r.loss)
    cheapest_win = min((r for r in ws if r.loss < matched.loss), key=lambda r: r.relative_ops, default=None)
    out = {"backbone_loss": base.loss, "matched_loss": matched.loss, "best_policy": best.policy,
           "best_loss": best.loss, "best_relative_ops": best.relative_ops,
           "best_gain_vs_matched": matched.loss - best.loss, "best_gain_vs_backbone": base.loss - best.loss,
           "beats_matched": best.loss < matched.loss,
           "cheapest_winning_policy": None if cheapest_win is None else cheapest_win.policy,
           "cheapest_winning_relative_ops": None if cheapest_win is None else cheapest_win.relative_ops}
    if best.loss < matched.loss:
        text = (f"verdict: the workspace beats the matched-token backbone: {best.policy} reaches {best.loss:.4f} vs "
                f"{matched.loss:.4f} ({matched.loss - best.loss:+.4f} nats) at {best.relative_ops:.3f}x the backbone's "
                f"ops; the cheapest winning policy is {cheapest_win.policy} at {cheapest_win.relative_ops:.3f}x")
    else:
        text = (f"verdict: the workspace does NOT beat the matched-token backbone: best {best.policy} "
                f"{best.loss:.4f} at {best.relative_ops:.3f}x ops vs matched {matched.loss:.4f} (backbone "
                f"{base.loss:.4f}; the workspace gains {base.loss - best.loss:+.4f} over its own backbone, "
                f"more training of the backbone gains {base.loss - matched.loss:+.4f})")
    out["text"] = text
    return out


def main(args: argparse.Namespace) -> int:
    """Entry point of `prisme demo`."""
    from .study_recall import parse_seeds

    threads = getattr(args, "threads", -1)
    text = getattr(args, "recall_seeds", "0,1")
    recall_seeds = [] if text in ("", "none") else parse_seeds(text)
    run_demo(out=getattr(args, "out", None), scale=getattr(args, "scale", 1.0),
             threads=threads if threads and threads > 0 else None, seed=getattr(args, "seed", 1337),
             backbone_keeps_learning=getattr(args, "backbone_keeps_learning", False),
             eval_batches=getattr(args, "eval_batches", 16), recall_seeds=recall_seeds)
    return 0
