"""`prisme bench workspace`: row plans, exact rewinds, the split timer, the checks, the document and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import assert_close

from prisme.bench import workspace as bw
from prisme.bench import workspace_report as bw_report
from prisme.cli import main as cli_main
from prisme.config import PrismeConfig
from prisme.costs.analytic import token_ops
from prisme.costs.traces import trace_cost
from prisme.model.policy import Forced
from prisme.options import ExecutionOptions


@pytest.fixture(scope="module")
def cfg() -> PrismeConfig:
    """The tiny preset with r_max = 8, so every seed-000 row fits."""
    return PrismeConfig.from_name("tiny", r_max=8)


@pytest.fixture(scope="module")
def doc(cfg: PrismeConfig) -> dict:
    """run_workspace on the tiny config, batch 1 and 8, a minimal protocol (computed once for the module)."""
    return bw.run_workspace((cfg,), bw.WorkspaceBenchOptions(batches=(1, 8), prompt_len=6, new_tokens=2, warmups=0,
                                                             repeats=1))


def decode(model, state, tokens, acts, budget):
    """Logits `[B, N, V]` of forced decoding `tokens` `[B, N]` with actions `[B, 1, n]`."""
    return torch.cat([state.decode_step(tokens[:, i:i + 1], policy=Forced(acts, budget=budget)).logits
                      for i in range(tokens.shape[1])], 1)


def test_row_plans_reproduce_seed_rows_ops(cfg):
    """At batch 1 each row's forced trace costs exactly token_ops of seed 000's row (n actions of k slots)."""
    M, T = cfg.n_slots, 10
    for row, (n, k) in bw.SEED_ROWS.items():
        acts, counts = bw.row_plan(cfg, row, 1)
        if n == 0:
            assert acts is None and counts == [0]
            continue
        assert counts == [n] and acts.shape == (1, n)
        dense = row.endswith("dense16")
        k = M if dense else k
        for optimised in (False, True):
            got = trace_cost(cfg, acts, [T], None, optimised).total_ops
            want = token_ops(cfg, T, [k] * n, controller_steps=0, optimised=optimised, dense=[dense] * n)["total"]
            assert got == want, (row, optimised)
    acts, _ = bw.row_plan(cfg, "4_actions_k2", 1)
    short = acts.clone()
    short[0, -1] = cfg.stop_action  # negative control: one action fewer must cost less
    assert trace_cost(cfg, short, [T]).total_ops < trace_cost(cfg, acts, [T]).total_ops


def test_row_plan_action_ids_and_ragged_budgets(cfg):
    """Singles are slots 0.., pairs ids M.., DENSE is A+1; at batch 8 row b takes ceil((b+1) n / 8) actions, then
    STOP."""
    M, stop = cfg.n_slots, cfg.stop_action
    assert bw.row_plan(cfg, "4_actions_k1", 1)[0].tolist() == [[0, 1, 2, 3]]
    assert bw.row_plan(cfg, "8_actions_k2", 1)[0].tolist() == [[M, M + 1, M, M + 1, M, M + 1, M, M + 1]]  # M/2 = 2
    assert bw.row_plan(cfg, "8_actions_dense16", 1)[0].tolist() == [[cfg.dense_action] * 8]
    acts, counts = bw.row_plan(cfg, "8_actions_k2", 8)
    assert counts == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ((acts != stop).sum(1)).tolist() == counts
    assert bw.row_plan(cfg, "4_actions_k1", 8)[1] == [1, 1, 2, 2, 3, 3, 4, 4]
    acts, counts = bw.row_plan(cfg, "4_actions_k1", 3)
    assert counts == [math.ceil(4 / 3), math.ceil(8 / 3), 4] and acts[0].tolist() == [0, 1, stop, stop]


def test_rewind_decodes_exactly_like_a_fresh_state(cfg):
    """A state rewound to P after decoding other tokens gives float64 logits bit-identical to a fresh state."""
    models = bw.build_models(cfg, seed=0, dtype=torch.float64)
    seq = bw.make_sequence(cfg.vocab_size, 2, 9, seed=1, device="cpu")
    prompt, new = seq[:, :6], seq[:, 6:]
    acts, counts = bw.row_plan(cfg, "4_actions_k2", 2)
    acts, budget = acts.unsqueeze(1), torch.tensor(counts).unsqueeze(1)
    with torch.inference_mode():
        fresh_state = models["opt"].new_decode_state(2, max_len=9)
        fresh_state.prefill(prompt, logits="none")
        fresh = decode(models["opt"], fresh_state, new, acts, budget)
        decode(models["opt"], fresh_state.rewind(6), (new + 3) % cfg.vocab_size, acts, budget)
        again = decode(models["opt"], fresh_state.rewind(6), new, acts, budget)
        short = decode(models["opt"], fresh_state.rewind(5), new, acts, budget)
    assert torch.equal(again, fresh)
    assert assert_close(short, fresh, atol=math.inf) > 1e-3  # negative control: one position short is visible
    with pytest.raises(ValueError, match="rewind"):
        fresh_state.rewind(9)


def test_split_timer_changes_nothing_sees_the_workspace_and_removes_itself(cfg):
    """Logits are bitwise unchanged under SplitTimer, its workspace section is 0 on the bypass and > 0 with edits,
    and no wrapper is left on the models after exit."""
    models = bw.build_models(cfg, seed=0)
    seq = bw.make_sequence(cfg.vocab_size, 1, 8, seed=2, device="cpu")
    paths = {p.name: p for p in bw._paths(models, 1, 6, 2, seq[:, :6])}
    p = paths["opt/4_actions_k1"]
    with torch.inference_mode():
        plain = torch.cat(bw._decode(p, seq[:, 6:]), 1)
        with bw.SplitTimer(list(models.values())) as st:
            timed = torch.cat(bw._decode(bw.rewind_path(p, 6), seq[:, 6:]), 1)
            with_edits = dict(st.ns)
            st.reset()
            bw._decode(bw.rewind_path(paths["backbone_only"], 6), seq[:, 6:])
            bypass = dict(st.ns)
    assert torch.equal(timed, plain)
    assert with_edits["workspace_modules"] > 0 and with_edits["backbone"] > 0 and with_edits["head"] > 0
    assert bypass["workspace_modules"] == 0 and bypass["backbone"] > 0
    for m in models.values():
        assert "streams" not in m.backbone.__dict__ and "head" not in m.backbone.__dict__
        assert not {"query_state", "apply_action", "logits_from_state"} & set(m.__dict__)
        assert not {"inputs", "from_inputs"} & set(m.bank.__dict__)


def test_build_models_share_weights_and_differ_only_in_optimised(cfg):
    """The three models hold the same tensors: optimised with and without the slot K/V cache, and the seed's, with a
    non-zero readout U."""
    models = bw.build_models(cfg, seed=3)
    a = models["opt"].state_dict()
    for other in ("opt_kv", "seed"):
        b = models[other].state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert models["opt"].cfg.optimised and not models["seed"].cfg.optimised
    assert models["opt_kv"].editor.run.slot_kv and not models["opt"].editor.run.slot_kv
    assert float(models["opt"].readout.U.weight.detach().abs().sum()) > 0


def test_workspace_checks_pass_and_negative_controls_fire(cfg):
    """Rewind and timers are exact, optimised and seed models agree to 1e-4 (float32), both controls exceed 1e-3."""
    checks = bw.workspace_checks(bw.build_models(cfg, seed=0), batch=2, P=6)
    assert checks["rewind_vs_fresh"] == 0 and checks["timer_transparency"] == 0
    assert max(checks["optimised_vs_seed"], checks["slot_kv_cache_vs_seed"]) <= bw.TOLERANCE[torch.float32]
    assert min(checks["negative_rewind_short"], checks["negative_other_slots"]) >= bw.NEGATIVE_CONTROL_MIN


def test_document_rows_analytic_columns_and_shares(doc, cfg):
    """Nine rows x model per batch; analytic ratios match trace_cost; shares and the target are computed as stated."""
    assert doc["checks"]["passed"]
    assert set(doc) >= {"scope", "environment", "protocol", "checks", "presets", "target", "profile"}
    (preset,) = doc["presets"]
    assert [b["batch"] for b in preset["batches"]] == [1, 8]
    for bt in preset["batches"]:
        rows = bt["rows"]
        assert [(r["row"], r["variant"]) for r in rows] == [("backbone_only", "-")] + [
            (row, v) for row in bw.ROWS[1:] for v in bw.VARIANTS]
        for r in rows:
            assert len(r["samples_ms"]) == 1 and r["step_ms_p50"] > 0
            acts, counts = bw.row_plan(cfg, r["row"], bt["batch"])
            assert r["actions_per_row"] == counts
            contexts = [6 + i + 1 for _ in counts for i in range(2)]
            traces = None if acts is None else acts.repeat_interleave(2, 0)
            pc = ExecutionOptions(slot_kv_cache=r["variant"] == "opt_kv").column  # the editor that ran
            for column, optimised in (("analytic_ratio_seed", False), ("analytic_ratio_optimised", True)):
                assert r[column] == pytest.approx(trace_cost(cfg, traces, contexts, None, pc(optimised)).relative,
                                                  1e-12)
            ran = trace_cost(cfg, traces, contexts, None, pc(r["variant"] in ("opt", "opt_kv", "-")))  # its own column
            assert r["analytic_ops_per_token"] == pytest.approx(ran.total_ops / ran.n_positions, 1e-12)
            if r["share_ratio"] is None:
                assert r["row"] == "backbone_only" and r["analytic_ratio_seed"] == 1.0
                continue
            assert r["analytic_ratio_optimised"] <= r["analytic_ratio_seed"]
            share = r["workspace_ms"] / r["backbone_pooled_ms"]
            assert r["share_ratio"] == pytest.approx(share / r["workspace_ops_share"], 1e-12)
            ratio = r["measured_workspace_matmul_ops_per_token"] / r["analytic_workspace_ops_first_step"]
            if bt["batch"] == 1:  # what ran is what the cost model counts
                assert ratio == pytest.approx(1.0, abs=1e-12)
            else:  # ragged rows: padded bank attention may run extra matmuls, never fewer
                assert ratio >= 1.0
    target = doc["target"][cfg.name]
    assert len(target["share_ratio"]) == 4 * len(bw.VARIANTS)
    assert target["met"] == all(v <= bw.TARGET_SHARE_RATIO for v in target["share_ratio"].values())
    by = {(r["row"], r["variant"]): r for r in preset["batches"][1]["rows"]}  # batch 8
    for variant in ("opt", "opt_kv"):  # each optimised model against the seed's, on the whole decode step
        o = target["optimised_vs_seed"][variant]
        for row, v in o["rows"].items():
            (a,), (b,) = by[(row, variant)]["samples_ms"], by[(row, "seed")]["samples_ms"]  # one repeat each
            saving = 1 - by[(row, variant)]["analytic_ops_per_token"] / by[(row, "seed")]["analytic_ops_per_token"]
            assert v["time_ratio"] == v["time_ratio_lo"] == v["time_ratio_hi"] == pytest.approx(a / b, 1e-12)
            assert v["ops_saving"] == pytest.approx(saving, 1e-12)
            assert v["met"] == (a / b <= 1 + bw.OPTIMISED_SLOWDOWN_MAX
                                and 1 - a / b >= bw.OPTIMISED_TIME_SHARE_MIN * saving)
        assert list(o["rows"]) == list(bw.ROWS[1:]) and o["met"] == all(v["met"] for v in o["rows"].values())
    kv_saving = target["optimised_vs_seed"]["opt_kv"]["rows"]["4_actions_k1"]["ops_saving"]
    assert kv_saving > target["optimised_vs_seed"]["opt"]["rows"]["4_actions_k1"]["ops_saving"] > 0


def test_time_ratio_is_paired_and_its_interval_covers_a_known_ratio():
    """Paired samples: a path 10% slower than its partner in every rotation, under a machine whose speed drifts 3x,
    gives 1.10 with a narrow interval; unpaired (one list reversed), the drift swamps it (negative control)."""
    drift = [1.0 + 2.0 * i / 19 for i in range(20)]
    b = [5.0 * x for x in drift]
    a = [1.1 * y * (1 + 0.01 * (-1) ** i) for i, y in enumerate(b)]
    ratio, lo, hi = bw_report.time_ratio(a, b)
    assert lo <= 1.1 <= hi and hi - lo < 0.01 and ratio == pytest.approx(1.1, rel=1e-3)
    _, lo_u, hi_u = bw_report.time_ratio(a, b[::-1])
    assert hi_u - lo_u > 20 * (hi - lo)


def test_profile_reports_each_workspace_row_and_model(cfg):
    """The profile covers every workspace row x model, with top ops (shares in (0, 1]), ATen call counts, method times,
    and nothing from the backbone's or head's ranges."""
    prof = bw.profile_workspace(bw.build_models(cfg, seed=0), batch=2, P=6, N=1, top=5)
    assert list(prof["rows"]) == [f"{v}/{row}" for row in bw.ROWS[1:] for v in bw.VARIANTS]
    for row in prof["rows"].values():
        assert 1 <= len(row["top"]) <= 5 and row["top_level_aten_calls_per_step"] > 0
        assert all(0 < t["share"] <= 1 and t["calls_per_step"] > 0 for t in row["top"])
        assert not any(t["op"].startswith("prisme::") for t in row["top"])
        assert set(row["workspace_methods_us_per_step"]) >= {"apply_action", "logits_from_state"}
        assert "backbone" not in row["workspace_methods_us_per_step"]


def test_bad_inputs_raise_before_any_work(cfg):
    """Rows beyond r_max, presets without a workspace, too-long prompts and empty batches are ValueErrors."""
    with pytest.raises(ValueError, match="r_max"):
        bw.run_workspace(presets=("tiny",))
    with pytest.raises(ValueError, match="no workspace"):
        bw.run_workspace(presets=("seed001",))
    with pytest.raises(ValueError, match="exceeds T_max"):
        bw.run_workspace((cfg,), bw.WorkspaceBenchOptions(prompt_len=cfg.max_seq_len))
    with pytest.raises(ValueError, match="batch"):
        bw.run_workspace((cfg,), bw.WorkspaceBenchOptions(batches=()))
    with pytest.raises(ValueError, match="unknown row"):
        bw.row_plan(cfg, "3_actions_k3", 1)


def test_cli_prints_table_then_json_last_and_writes_the_file(doc, tmp_path, monkeypatch, capsys):
    """`prisme bench workspace` prints the table, writes --json, and ends stdout with the same JSON document."""
    seen = {}

    def fake_run(presets, options):
        seen.update(presets=presets, options=options)
        return doc

    monkeypatch.setattr(bw, "run_workspace", fake_run)
    out = tmp_path / "ws.json"
    assert cli_main(["bench", "workspace", "--presets", "demo", "--batches", "1,8", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "prisme bench workspace" in stdout and "target at batch 8" in stdout
    lines = stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    assert json.loads("\n".join(lines[start:])) == json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert seen["presets"] == ("demo",) and seen["options"].batches == (1, 8) and seen["options"].threads is None


def test_cli_reports_bad_flags_as_errors(capsys):
    """A preset whose r_max is below 8 and a malformed --batches exit with status 2 and one clear line."""
    assert cli_main(["bench", "workspace", "--presets", "tiny"]) == 2
    assert "r_max" in capsys.readouterr().err
    assert cli_main(["bench", "workspace", "--batches", "1,x"]) == 2
    assert "--batches" in capsys.readouterr().err


def test_compiled_variant_agrees_with_seed_is_priced_in_the_seed_column_and_says_what_ran(cfg):
    """`--compile`: the compiled editor's rows (a ragged batch of 2: padded rows) pass the equivalence check against
    the seed model, carry the seed column's analytic ops, and name their path."""
    d = bw.run_workspace((cfg,), bw.WorkspaceBenchOptions(batches=(2,), prompt_len=6, new_tokens=2, warmups=1,
                                                          repeats=1, compile=True))
    checks = d["checks"]["by_preset"][cfg.name]
    assert checks["compiled_vs_seed"] <= bw.TOLERANCE[torch.float32] and d["checks"]["passed"]
    for bt in d["presets"][0]["batches"]:
        by = {(r["row"], r["variant"]): r for r in bt["rows"]}
        for row in bw.ROWS[1:]:
            comp, seed = by[(row, bw.COMPILED)], by[(row, "seed")]
            assert comp["analytic_ops_per_token"] == seed["analytic_ops_per_token"]
            assert comp["path"] == bw.PATHS[bw.COMPILED] and "compiled" in comp["path"]
    assert "compiled editor, workspace time seed / compiled" in bw.format_workspace_table(d)
