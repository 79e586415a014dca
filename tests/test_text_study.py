"""The text study's pieces: a stage-1 backbone rebased under another workspace config is exactly what training stage 1
with that config gives; a workspace kept under a new controller config; verdict lines that follow the intervals."""

from __future__ import annotations

import pytest
import torch

from prisme.checkpoint import load_model
from prisme.config import PrismeConfig
from prisme.model.prisme import PrismeModel
from prisme.rebase import rebase, rebase_backbone
from prisme.studies.text_report import seed_summary, verdicts
from prisme.training.config import StageConfig
from prisme.training.trainer import train_stage

MQ = dict(vocab_size=64, seq_len=16, n_pairs=2, query_min_pos=4)


def stage1(tmp_path, cfg: PrismeConfig, name: str, seed: int = 3):
    s = StageConfig(stage="backbone", steps=3, batch_size=4, seq_len=16, out_dir=str(tmp_path / name), seed=seed,
                    dataset="mqar", mqar=MQ, progress=False, eval_every=0, eval_batches=1)
    return train_stage(cfg, s).checkpoint


def test_rebased_backbone_equals_training_stage_1_under_that_config(tmp_path):
    """Stage 1 never touches the workspace: rebasing the seed's-config stage-1 checkpoint under the embedding-bank
    config gives bitwise the weights (backbone and fresh workspace) of training stage 1 with that config."""
    plain = PrismeConfig.from_name("tiny")
    other = plain.replace(bank_source="embedding", bank_shift=True, controller_source="residual",
                          controller_bank=True)
    reb = rebase_backbone(stage1(tmp_path, plain, "plain"), other, tmp_path / "rebased", seed=3)
    direct = stage1(tmp_path, other, "direct")
    a, meta = load_model(reb)
    b, _ = load_model(direct)
    assert meta.stage == "backbone" and a.cfg.bank_shift
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    wrong = load_model(rebase_backbone(stage1(tmp_path, plain, "plain2"), other, tmp_path / "r2", seed=4))[0]
    assert not all(torch.equal(wrong.state_dict()[k], sb[k]) for k in sb)  # negative control: another seed differs
    with pytest.raises(ValueError, match="d_model"):
        rebase_backbone(stage1(tmp_path, plain, "plain3"), plain.replace(d_model=64, n_head=4), tmp_path / "r3", 3)


def test_rebase_keeping_the_workspace_changes_only_the_controller(tmp_path):
    """keep=("backbone", "workspace") copies both groups into a config with other controller features and starts a
    fresh controller; a config whose workspace shapes differ is refused."""
    cfg = PrismeConfig.from_name("tiny")
    torch.manual_seed(0)
    from prisme.checkpoint import TrainingState, save_checkpoint

    src = PrismeModel(cfg)
    path = save_checkpoint(tmp_path / "ws" / "ckpt_000005", src, TrainingState(stage="workspace", step=5))
    new = cfg.replace(controller_entropy=True, controller_bank=True)
    out, meta = load_model(rebase(path, new, tmp_path / "out", seed=1, keep=("backbone", "workspace")))
    assert meta.stage == "workspace" and out.cfg.controller_entropy
    for group in ("backbone_parameters", "workspace_parameters"):
        assert all(torch.equal(p, q) for p, q in zip(getattr(out, group)(), getattr(src, group)()))
    assert out.controller.mlp[0].weight.shape[1] == src.controller.mlp[0].weight.shape[1] + 3  # 3 more features
    with pytest.raises(ValueError, match="does not fit"):
        rebase(path, cfg.replace(w=64, ws_head_dim=16), tmp_path / "bad", seed=1, keep=("backbone", "workspace"))
    with pytest.raises(ValueError, match="backbone checkpoint"):
        rebase(path, new, tmp_path / "bad2", seed=1)


def _row(policy, family, d_b, d_m, d_eq=None, ops=1.0, gap=None):
    ci = lambda m, lo, hi: {"mean": m, "lo": lo, "hi": hi, "n_sequences": 10, "n_tokens": 100}  # noqa: E731
    v = lambda d: None if d is None else ("beats" if d[2] < 0 else "loses" if d[1] > 0 else "ties")  # noqa: E731
    return {"policy": policy, "family": family, "deployable": family != "oracle", "relative_ops": ops, "loss": 1.0,
            "lambda_cost": 0.1, "delta_vs_backbone": ci(*d_b), "delta_vs_matched": ci(*d_m),
            "verdict_vs_backbone": v(d_b), "verdict_vs_matched": v(d_m),
            "delta_vs_equal_edits": None if d_eq is None else ci(*d_eq), "verdict_vs_equal_edits": v(d_eq),
            "frontier_gap": None if gap is None else ci(*gap)}


def test_verdicts_count_the_seeds_whose_interval_lies_below_zero():
    """Over two seeds: a row is said to beat the dense frontier only when its interval is below 0 on every seed;
    an interval that holds 0 does not count, whatever its point estimate; the counts are per seed."""
    def seed(gap_fixed, gap_ctrl, eq):
        rows = [_row("L2_d128", "reference", (-0.2, -0.25, -0.15), (-0.19, -0.22, -0.16), ops=1.87),
                _row("fixed_1xk1", "fixed", (-0.004, -0.006, -0.002), (-0.003, -0.008, 0.001), ops=2.3,
                     gap=gap_fixed),
                _row("controller(lambda=0.1)", "controller", (0.01, 0.005, 0.02), (0.012, 0.006, 0.02), d_eq=eq,
                     ops=1.5, gap=gap_ctrl)]
        return {"sources": {"residual": {"val": {"rows": rows}, "held_out": {"rows": rows}}}}

    doc = {"seeds": {"1": seed((-0.01, -0.02, -0.005), (0.1, 0.05, 0.2), (-0.001, -0.003, -0.0002)),
                     "2": seed((-0.01, -0.02, 0.001), (0.1, 0.05, 0.2), (-0.001, -0.003, -0.0002))}}
    summary = seed_summary(doc)
    fixed = next(e for e in summary if e["policy"] == "fixed_1xk1" and e["split"] == "val")
    assert fixed["frontier_gap_below"] == 1 and fixed["delta_vs_matched_below"] == 0 and len(fixed["seeds"]) == 2
    doc["summary"] = summary
    lines = verdicts(doc)
    assert any("L2_d128" in x and "beats the matched backbone on 2/2 seeds" in x for x in lines)
    assert any("fixed_1xk1" in x and "below it on 1/2 seeds" in x and "does not beat the dense frontier" in x
               for x in lines)
    assert any("controller(lambda=0.1) minus its equal-edits baseline: below on 2/2 seeds" in x for x in lines)
    doc["seeds"]["2"] = seed((-0.01, -0.02, -0.001), (0.1, 0.05, 0.2), (-0.001, -0.003, -0.0002))
    doc["summary"] = seed_summary(doc)
    assert any("below it on 2/2 seeds" in x and "-> beats the dense frontier on every seed" in x
               for x in verdicts(doc))


def test_bad_text_study_settings_are_value_errors_naming_the_option():
    from prisme.config import PrismeConfig
    from prisme.studies.recall_setup import parse_seeds
    from prisme.studies.text_setup import TextStudyConfig

    demo = PrismeConfig.from_name("demo")
    for kw, word in ((dict(seeds=[]), "seeds"), (dict(seeds=[1, 1]), "distinct"), (dict(seeds=[-1]), "seeds"),
                     (dict(frontier=[[0, None]]), "frontier"), (dict(frontier=[[1, 100]]), "frontier entry"),
                     (dict(slice_ngram=0), "slice_ngram"), (dict(window=512), "longer than the preset"),
                     (dict(frontier=[[1, None, "yes"]]), "frontier"), (dict(frontier=[[1, None, True, 0]]), "frontier"),
                     (dict(frontier=[]), "frontier"), (dict(context=1), "--context"),
                     (dict(context=1024, window=512), "--window and --context"),
                     (dict(context=1024, context_model={"attn_window": 0}), "context_model"),
                     (dict(context=1024, context_model={"no_such_field": 1}), "context_model"),
                     (dict(context=1024, context_frontier=[[1, None, True, 2048]]), "frontier entry"),
                     (dict(context=1024, context_lambdas=[]), "context_lambdas")):
        with pytest.raises(ValueError, match=word):
            TextStudyConfig(**kw).validate(demo)
    assert parse_seeds("3,1") == [3, 1]
    from prisme.studies.text_setup import parse_frontier

    assert parse_frontier("1,2,1x96") == [[1, None], [2, None], [1, 96]]
    assert parse_frontier("2ks,1w64ks,3x96w32,1w64") == [[2, None, True], [1, None, True, 64], [3, 96, False, 32],
                                                         [1, None, False, 64]]
    for bad in ("", "a", "2x", "1ksw64", "1w", "x96"):
        with pytest.raises(ValueError, match="--frontier"):
            parse_frontier(bad)
    for bad in ("", "1,1", "a", "-2"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_text_study_over_two_seeds_reports_each_seed_and_the_frontier_gaps(tmp_path):
    """`run_study` with two training seeds and a two-model frontier (byte-level tiny, a few steps): every run lands
    in its seed's folder; every deployable workspace row has a frontier gap on each seed, and the summary and the
    verdicts count the seeds."""
    from prisme.config import PrismeConfig
    from prisme.studies.text import TextStudyConfig, format_report, run_study

    held = tmp_path / "held_out.txt"
    held.write_text("Abasement, n. A decent and customary mental attitude in the presence of wealth. " * 6)
    cfg = TextStudyConfig(sources=["residual"], seeds=[3, 4], frontier=[[2, None], [1, 16]], scale=0.01,
                          val_batches=1, held_out=str(held), jobs=1, progress=False, bootstrap_samples=100,
                          out_dir=str(tmp_path / "text"))
    model = PrismeConfig.from_name("tiny", vocab_size=256)
    doc = run_study(cfg, model)
    assert list(doc["seeds"]) == ["3", "4"] and doc["frontier"] == [f"L2_d{model.d_model}", "L1_d16"]
    for s in ("3", "4"):
        assert (tmp_path / "text" / f"seed{s}" / "frontier" / "L1_d16" / "latest").exists()
        for split in ("val", "held_out"):
            rows = doc["seeds"][s]["sources"]["residual"][split]["rows"]
            assert all(r["frontier_gap"] for r in rows if r["deployable"] and r["family"] in ("fixed", "controller"))
    fixed = [e for e in doc["summary"] if e["policy"] == "fixed_1xk1"]
    assert {e["split"] for e in fixed} == {"val", "held_out"} and all(len(e["frontier_gap"]) == 2 for e in fixed)
    assert all(0 <= e["frontier_gap_below"] <= 2 for e in fixed)
    assert all(set(sl) == {"ar_hit", "seen_miss", "other"} for e in fixed for sl in e["slices"])
    assert any("/2 seeds" in line and "dense frontier" in line for line in doc["verdicts"])
    assert "over the training seeds 3, 4" in format_report(doc)
    assert run_study(cfg, model)["seeds"] == doc["seeds"]  # the same settings again: every task kept, none rerun
    with pytest.raises(ValueError, match="other settings"):
        run_study(TextStudyConfig(**{**cfg.__dict__, "seeds": [3]}), model)


def test_frontier_entries_carry_the_key_shift_and_the_window_as_data():
    """Every help PRISME's bank gets the dense family gets too: a frontier entry names its backbone's key shift and
    attention window, and the model it makes has exactly those (and never the preset's own, nor a workspace)."""
    from prisme.studies.text_setup import (
        DEFAULT_FRONTIER,
        TextStudyConfig,
        frontier_config,
        frontier_name,
        source_config,
    )

    demo = PrismeConfig.from_name("demo")
    assert source_config(demo, "residual_shift").bank_shift and not demo.bank_shift  # an induction-style bank
    TextStudyConfig(sources=["residual_shift"]).validate(demo)
    local = TextStudyConfig(context=1024).study_model(demo)  # a 64-window key-shift backbone with a router
    assert (local.attn_window, local.key_shift, local.router, local.max_seq_len) == (64, True, True, 1024)
    assert [1, None, True] in DEFAULT_FRONTIER and [3, None, True] in DEFAULT_FRONTIER
    for entry, name, ks, win in (([1, None], "L1_d128", False, None), ([2, None, True], "L2_d128_ks", True, None),
                                 ([1, 96, True, 64], "L1_d96_w64_ks", True, 64), ([3, None, False, 64], "L3_d128_w64",
                                                                                  False, 64)):
        for base in (demo, local):
            m = frontier_config(base, *entry)
            assert (m.name, m.key_shift, m.attn_window, m.use_workspace, m.router) == (name, ks, win, False, False)
            assert frontier_name(base, *entry) == name


def test_long_context_stages_keep_bytes_per_step_and_train_the_frontier_on_prisme_s_bytes(tmp_path):
    """`--context T`: every stage reads as many bytes per step as at 128 (batch 16 x 128 -> 2 x 1,024), the third
    stage is the router's at budget 1, the matched run reads stage 2's bytes and every frontier model PRISME's three
    stages' bytes together."""
    from prisme.studies.text_setup import TextStudyConfig, final_folder, stage_configs

    cfg = TextStudyConfig(context=1024, out_dir=str(tmp_path))
    st = stage_configs(cfg, cfg.study_model(PrismeConfig.from_name("demo")), 1337)
    nbytes = lambda s: s.steps * s.batch_size * s.seq_len  # noqa: E731
    for k in ("backbone", "workspace", "matched"):
        assert st[k].seq_len == 1024 and st[k].batch_size * st[k].seq_len == 2048
    r = st["controller"]
    assert (r.stage, r.max_budget, r.batch_size, r.steps, r.oracle_positions) == ("router", 1, 1, 100, 64)
    assert final_folder(st) == "3_router" and nbytes(st["matched"]) == nbytes(st["workspace"])
    prisme_bytes = sum(nbytes(st[k]) for k in ("backbone", "workspace", "controller"))
    names = [k for k in st if k.startswith("frontier:")]
    assert len(names) == len(cfg.context_frontier) == 8
    assert all(0 <= nbytes(st[k]) - prisme_bytes < 2048 for k in names)
    assert final_folder(stage_configs(TextStudyConfig(out_dir=str(tmp_path)), PrismeConfig.from_name("demo"),
                                      1)) == "4_controller"


def test_long_context_text_study_scores_a_local_backbone_with_a_routed_workspace_against_dense_global_attention(
        tmp_path):
    """`run_study` with `context` (byte-level tiny at T = 64, PRISME's backbone a 16-window): the frontier is the dense
    models alone (PRISME's own backbone is a row, not the frontier), the deployed rows are the router's at budget 1
    with a frontier gap, and every row splits its AR hits by PRISME's window, in the report too."""
    from prisme.studies.text import TextStudyConfig, format_report, run_study

    held = tmp_path / "held_out.txt"
    held.write_text("Abasement, n. A decent one. " * 24)  # 28 bytes apart: every repeat beyond a 16-byte window
    cfg = TextStudyConfig(sources=["embedding"], seeds=[3], scale=0.01, val_batches=1, held_out=str(held), jobs=1,
                          progress=False, bootstrap_samples=50, out_dir=str(tmp_path / "text"), context=64,
                          context_model={"attn_window": 16, "key_shift": True, "router": True, "router_ngram": 2},
                          context_frontier=[[1, None, True], [1, None, True, 16]], context_eval_batch_size=2,
                          context_lambdas=[0.0, 1e9])
    doc = run_study(cfg, PrismeConfig.from_name("tiny", vocab_size=256))
    d = PrismeConfig.from_name("tiny").d_model
    assert doc["frontier"] == [f"L1_d{d}_ks", f"L1_d{d}_w16_ks"]
    assert (tmp_path / "text" / "seed3" / "embedding" / "3_router" / "latest").exists()
    for split in ("val", "held_out"):
        rep = doc["seeds"]["3"]["sources"]["embedding"][split]
        assert sorted(rep["frontier"]) == sorted(doc["frontier"]) and rep["seq_len"] == 64
        rows = {r["policy"]: r for r in rep["rows"]}
        free, never = rows["controller(lambda=0)"], rows["controller(lambda=1e+09)"]
        assert free["deployable"] and free["frontier_gap"] and free["budget"] == 1
        assert never["mean_edits"] == 0 and never["loss"] == rows["backbone"]["loss"]  # routed off: the backbone
        assert free["mean_edits"] >= never["mean_edits"] and free["relative_ops"] >= never["relative_ops"]
        for r in rows.values():  # every row but the oracle's (scored on its sampled positions alone)
            assert r["family"] == "oracle" or set(r["slices"]) == {"ar_hit_in_window", "ar_hit_beyond_window",
                                                                   "seen_miss", "other"}
    held_rows = {r["policy"]: r for r in doc["seeds"]["3"]["sources"]["embedding"]["held_out"]["rows"]}
    assert held_rows["backbone"]["slices"]["ar_hit_beyond_window"]["share_of_targets"] > 0.5
    assert "loss by slice" in format_report(doc) and "AR hit beyond" in format_report(doc)


def _seed_blocks(names: list[str], seeds: list[int]) -> list[int]:
    """For each task name of a main seed, in list order, the seed it belongs to (the confirmation's left out)."""
    return [int(n[1:].split("/")[0]) for n in names if n.startswith("s") and int(n[1:].split("/")[0]) in seeds]


def test_a_seeds_evaluations_start_before_the_next_seeds_training(tmp_path):
    """Tasks start in list order once their needs are met: each seed's tasks (its chains, then its evaluations) come
    as one block, so the first seed's verdict is scored while the later seeds train, and a study stopped part way
    has whole seeds to show. Negative control: the order with every seed's chains first interleaves the seeds."""
    from prisme.studies import text

    held = tmp_path / "held.txt"
    held.write_text("Abasement, n. A decent and customary mental attitude in the presence of wealth. " * 6)
    cfg = text.TextStudyConfig(sources=["residual"], seeds=[3, 4], frontier=[[1, 16]], scale=0.01, val_batches=1,
                               held_out=str(held), jobs=1, progress=False, out_dir=str(tmp_path / "a"))
    _, _, tasks = text.prepare_study(cfg, PrismeConfig.from_name("tiny", vocab_size=256))
    names = [t.name for t in tasks]
    blocks = _seed_blocks(names, [3, 4])

    def contiguous(order: list[int]) -> bool:
        return all(a <= b for a, b in zip(order, order[1:]))

    assert contiguous(blocks) and blocks.count(3) == blocks.count(4) > 2
    assert any("eval" in n for n in names[:blocks.count(3)])  # seed 3's evaluations inside its own block
    chains_first = sorted(names[:len(blocks)], key=lambda n: ("eval" in n or "matched" in n, n))
    assert not contiguous(_seed_blocks(chains_first, [3, 4]))


def test_so_far_reports_the_seeds_whose_evaluations_finished(tmp_path):
    """`--so-far` on a study part done: the document of the seeds whose evaluations have all finished, equal to the
    finished study's rows for those seeds, nothing trained; a seed with one evaluation missing is left out, and a
    study with none finished is a ValueError saying so (negative control: the missing evaluation is noticed)."""
    import shutil

    from prisme.studies import text
    from prisme.studies.records import STUDY_DIR, store_path

    held = tmp_path / "held.txt"
    held.write_text("Abasement, n. A decent and customary mental attitude in the presence of wealth. " * 6)
    model = PrismeConfig.from_name("tiny", vocab_size=256)
    cfg = text.TextStudyConfig(sources=["residual"], seeds=[3, 4], frontier=[[1, 16]], scale=0.01, val_batches=1,
                               held_out=str(held), jobs=1, progress=False, bootstrap_samples=20, eval_batch_size=8,
                               out_dir=str(tmp_path / "a"), confirm_seeds=None)
    full = text.run_study(cfg, model)
    store = tmp_path / "a" / STUDY_DIR / "done"
    kept = tmp_path / "kept"
    shutil.copytree(store, kept)
    store_path(store, text.EvalTask(4, "residual", "val").name).unlink()  # seed 4 not finished
    doc = text.document_so_far(cfg, model)
    assert list(doc["seeds"]) == ["3"] and doc["so_far"]["seeds"] == [3] and doc["so_far"]["study_seeds"] == [3, 4]
    assert doc["seeds"]["3"]["sources"] == full["seeds"]["3"]["sources"]
    assert all(e["seeds"] == [3] for e in doc["summary"])
    report = text.format_report(doc)
    assert report.startswith("so far: seeds 3 of the study's 3, 4 have finished")
    for seed in (3,):
        store_path(store, text.EvalTask(seed, "residual", "held_out").name).unlink()
    with pytest.raises(ValueError, match="no seed of the study .* has finished its evaluations yet"):
        text.document_so_far(cfg, model)
    shutil.rmtree(store)
    shutil.copytree(kept, store)
    again = text.document_so_far(cfg, model)  # every seed back: the finished study's rows
    assert list(again["seeds"]) == ["3", "4"] and again["summary"] == full["summary"]


def test_so_far_takes_neither_resume_nor_reuse(tmp_path, capsys):
    """--so-far reads a study as it stands: with --resume or --reuse it is refused, naming both, before anything."""
    from prisme import cli

    for extra in (["--resume"], ["--reuse", str(tmp_path / "other")]):
        assert cli.main(["study", "text", "--seeds", "3", "--out", str(tmp_path / "s"), "--so-far", *extra]) == 2
        assert "--so-far reports a study as it stands: it takes neither --resume nor --reuse" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing written
