"""The recall showcase's machinery: MQAR without the echo, the source-bank options' configs and checkpoints, the
stages' shortcuts that are exact (workspace at labelled positions only, zero controller targets without a label),
the controller's bank match, and `prisme study recall` (its bad input and its JSON schema on a quick run)."""

from __future__ import annotations

import json
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch
from conftest import assert_close

from prisme import cli
from prisme.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from prisme.config import PrismeConfig
from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.model.prisme import PrismeModel
from prisme.studies.recall_eval import evaluate_backbone
from prisme.studies.recall_setup import RecallStudyConfig, parse_seeds, study_config
from prisme.training.config import StageConfig
from prisme.training.objectives import WorkspaceObjective
from prisme.training.oracle_objectives import ControllerObjective
from prisme.training.trainer import train_stage

MQ = dict(vocab_size=64, seq_len=32, n_pairs=4, query_min_pos=8)


def recall_model(dtype=torch.float64, seed: int = 0, **overrides) -> PrismeModel:
    torch.manual_seed(seed)
    model = PrismeModel(PrismeConfig.from_name("recall", **overrides)).to(dtype)
    torch.nn.init.normal_(model.readout.U.weight, std=0.3)  # U starts at zero, which would hide every edit
    return model


# ---------------------------------------------------------------------- configs
@pytest.mark.parametrize("bad, field", [
    (dict(bank_source="residuals"), "bank_source"), (dict(bank_source="layer7"), "bank_source"),
    (dict(bank_source="embedding+embedding"), "bank_source"), (dict(query_source="layerx"), "query_source"),
    (dict(bank_source="residual+embedding+layer1"), "bank_source"), (dict(bank_shift="yes"), "bank_shift"),
    (dict(controller_source="residual+embedding"), "controller_source"), (dict(controller_bank=1), "controller_bank"),
])
def test_bad_source_options_are_value_errors_naming_the_field(bad, field):
    """Unknown sources, out-of-range layers, repeats, three terms, non-bool switches: ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        PrismeConfig.from_name("tiny", **bad)


def test_source_specs_are_canonical_and_the_seed_default_is_unchanged():
    """layer0 is the embeddings, layer<L> the residual stream; query_source defaults to bank_source; the default config
    reads H only (its state dict holds exactly the seed's bank parameters)."""
    cfg = PrismeConfig.from_name("tiny", bank_source="layer0+layer2")
    assert cfg.bank_terms == ("embedding", "residual") and cfg.query_terms == cfg.bank_terms
    plain = PrismeConfig.from_name("tiny")
    assert plain.default_sources and plain.query_source == "residual"
    names = {n.split(".")[0] for n in PrismeModel(plain).state_dict()}
    assert names == {"backbone", "bank_norm", "W_K", "W_V", "P", "slot_embed", "editor", "readout", "controller"}


def test_a_shifted_bank_on_a_checkpoint_saved_without_it_is_a_value_error(tmp_path):
    """Loading a checkpoint saved without a shift for a config with one (and the reverse) is a ValueError naming
    bank_shift; a workspace stage asked to start so fails before anything trains."""
    plain = PrismeModel(PrismeConfig.from_name("tiny"))
    save_checkpoint(tmp_path / "plain", plain, TrainingState(stage="backbone", step=1))
    shifted = PrismeModel(PrismeConfig.from_name("tiny", bank_shift=True))
    save_checkpoint(tmp_path / "shifted", shifted, TrainingState(stage="backbone", step=1))
    with pytest.raises(ValueError, match="bank_shift"):
        load_checkpoint(tmp_path / "plain", expected_config=shifted.cfg)
    with pytest.raises(ValueError, match="bank_shift"):
        load_checkpoint(tmp_path / "shifted", expected_config=plain.cfg)
    out = tmp_path / "ws"
    with pytest.raises(ValueError, match="bank_shift"):
        train_stage(shifted.cfg, StageConfig(stage="workspace", steps=1, init_from=str(tmp_path / "plain"),
                                             out_dir=str(out), dataset="mqar", mqar=MQ, progress=False))
    assert not out.exists()


@pytest.mark.parametrize("bad", [dict(seq_len=12), dict(n_pairs=40), dict(n_queries=5), dict(echo_value="no")])
def test_an_mqar_layout_that_cannot_fit_is_a_value_error_before_training(tmp_path, bad):
    """Too short a sequence, too many pairs for the vocabulary, more queries than pairs, a non-bool echo flag."""
    with pytest.raises(ValueError):
        train_stage(PrismeConfig.from_name("recall"), StageConfig(
            stage="backbone", steps=1, out_dir=str(tmp_path / "r"), dataset="mqar", mqar={**MQ, **bad}, progress=False))
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------- exact shortcuts of the stages
def _workspace_loss(model, scfg, x, y, full: bool, monkeypatch=None):
    obj = WorkspaceObjective(model, scfg)
    extra = obj.sample(x, y, torch.Generator().manual_seed(3))
    if full:  # the reference: every position runs its workspace
        obj._labelled_queries = lambda st, a, b, yy: (model.context_from_H(st, st), a, b, yy)
    model.zero_grad()
    loss, _ = obj(x, y, extra, obj.denominators(x, y, extra))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.workspace_parameters() if p.grad is not None]


def test_workspace_stage_at_labelled_positions_equals_every_position_float64():
    """Running the workspace only where a label is (MQAR: the queries) gives the loss and every gradient of the full
    rollout to 1e-12: positions never read each other's workspace, and unlabelled ones add no loss."""
    model = recall_model()
    x, y = make_mqar_batch(MQARConfig(**MQ), 6, torch.Generator().manual_seed(1))
    scfg = StageConfig(stage="workspace", max_budget=2, deep_supervision=0.5)
    loss_q, g_q = _workspace_loss(model, scfg, x, y, full=False)
    loss_f, g_f = _workspace_loss(model, scfg, x, y, full=True)
    assert_close(loss_q, loss_f, 1e-12, "loss")
    assert len(g_q) == len(g_f) > 0
    for a, b in zip(g_q, g_f):
        assert_close(a, b, 1e-12, "grad")
    y_drop = y.clone()  # negative control: losing one labelled position changes the loss
    y_drop[0, (y[0] != IGNORE_INDEX).nonzero()[0, 0]] = IGNORE_INDEX
    assert abs(float(_workspace_loss(model, scfg, x, y_drop, full=False)[0] - loss_q)) > 1e-4


def test_controller_targets_are_zero_without_a_label_and_no_candidate_runs_there():
    """With unlabelled_value="zero", every sampled position is a target, dL is exactly 0 where no label is, and the
    oracle executes candidates only at the labelled positions (the editor sees A edits per labelled position)."""
    model = recall_model()
    x, y = make_mqar_batch(MQARConfig(**MQ), 4, torch.Generator().manual_seed(2))
    obj = ControllerObjective(model, StageConfig(stage="controller", oracle_positions=32))
    extra = obj.sample(x, y, torch.Generator().manual_seed(0))
    extra["budget"][:] = 1
    seen, edited = [], []
    handle = model.editor.register_forward_hook(
        lambda m, a, out: edited.append(int((a[2] != model.cfg.stop_action).sum())))
    obj.oracle_rollout(x, y, extra, lambda r, ctx, S, e, t, b, dL, valid: seen.append((dL, valid)))
    handle.remove()
    dL, valid = seen[0]
    pos, labelled = obj.positions(y, extra["scores"])
    assert valid.all() and pos.shape[1] == 32
    assert (dL[~labelled] == 0).all() and (dL[labelled].abs() > 0).any()
    assert edited[0] == int(labelled.sum()) * model.cfg.n_actions  # candidates at labelled positions only
    skip = ControllerObjective(model, StageConfig(stage="controller", oracle_positions=32, unlabelled_value="skip"))
    skip.oracle_rollout(x, y, extra, lambda r, ctx, S, e, t, b, dL, valid: seen.append((dL, valid)))
    assert torch.equal(seen[-1][1], labelled)  # "skip": only labelled positions are targets


def test_bank_match_reads_the_earlier_keys_only():
    """BankMatch: the max and log-mean-exp of q_c . K_j / sqrt(w) over j < t (zeros at position 0); a query that
    copies an earlier key scores that key's dot product as its max."""
    model = recall_model()
    bm = model.controller.bank_match
    w = model.cfg.w
    K = torch.randn(1, 5, w, dtype=torch.float64)
    zc = torch.randn(1, 5, w, dtype=torch.float64)
    mask = PrismeModel.bank_mask(1, 5, 5)
    out = bm(zc, K, mask)
    q = bm.W_bank(zc)
    for t in range(5):
        s = (q[0, t] @ K[0, :t].T) * w ** -0.5
        want = torch.zeros(2, dtype=torch.float64) if t == 0 else torch.stack(
            [s.max(), torch.logsumexp(s, 0) - torch.log(torch.tensor(float(t), dtype=torch.float64))])
        assert_close(out[0, t], want, 1e-12, f"t={t}")
    K2 = K.clone()
    K2[0, 4] += 100.0  # its own key is not read: position 4's features do not move
    assert torch.equal(bm(zc, K2, mask)[0, 4], out[0, 4])


# ---------------------------------------------------------------------- the study
def test_study_seeds_must_be_a_nonempty_list_of_nonnegative_ints(tmp_path, capsys):
    """--seeds empty, negative, non-integer or repeated: a one-line error (exit 2) before anything trains."""
    for bad in ("", "1,-2", "a", "0,0"):
        with pytest.raises(ValueError, match="seeds"):
            parse_seeds(bad)
        rc = cli.main(["study", "recall", "--seeds", bad, "--out", str(tmp_path / "s"), "--no-progress"])
        assert rc == 2 and "seeds" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    assert parse_seeds("3, 1") == [3, 1]
    with pytest.raises(ValueError, match="lambdas"):
        RecallStudyConfig(lambdas=[float("nan")]).validate()


def test_forced_rows_scored_at_the_queries_equal_the_full_forward():
    """The study scores forced policies at the query positions only; that equals the accuracy of model(x, actions)
    over every position (here for the budget-1 policy and the backbone)."""
    from prisme.studies.recall_eval import _batches, forced_row

    model = recall_model(torch.float32).eval()
    mcfg = MQARConfig(**MQ)
    row = forced_row(model, mcfg, 5, 64, "fixed_1xk1", "fixed", 1, 1)
    x, y = next(iter(_batches(mcfg, 64, 5)))
    with torch.no_grad():
        logits = model(x, torch.zeros(64, 32, 1, dtype=torch.long)).logits
    lab = y != IGNORE_INDEX
    assert row["accuracy"] == float((logits.argmax(-1)[lab] == y[lab]).float().mean())
    assert row["edits_per_token"] == 1.0 and row["ops_ratio"] > 1.0
    with torch.no_grad():
        base = model(x).logits
    assert evaluate_backbone(model, mcfg, 5, 64) == float((base.argmax(-1)[lab] == y[lab]).float().mean())


def test_study_quick_run_writes_the_documented_json(tmp_path):
    """`prisme study recall --quick` runs every phase (controls, a seed, the converged case) and prints one JSON
    document, last on stdout, with the fields other tools read; its checkpoints load."""
    out = tmp_path / "study"
    buf = StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["study", "recall", "--quick", "--jobs", "1", "--out", str(out), "--no-progress",
                       "--json", str(tmp_path / "r.json")])
    assert rc == 0
    text = buf.getvalue()
    doc = json.loads(text[text.index("\n{") + 1:])
    assert doc == json.loads((tmp_path / "r.json").read_text())
    for k in ("one_layer", "two_layer"):
        assert 0 <= doc["controls"][k]["accuracy"] <= 1
    assert len(doc["seeds"]) == 1
    for e in (doc["seeds"][0], doc["converged"]["seeds"][0]):
        assert {"seed", "budget1_accuracy", "xattn_correct_value", "gate_query", "gate_other", "delta_over_H",
                "fixed", "controller", "controllers"} <= set(e)
        assert all({"policy", "accuracy", "ops_ratio", "edits_per_token"} <= set(r) for r in e["fixed"])
        assert all({"lambda", "accuracy", "ops_ratio", "edits_per_token", "query_edit_share"} <= set(r)
                   for r in e["controllers"])
        assert e["controller"]["lambda"] in [r["lambda"] for r in e["controllers"]]
        assert 0 <= e["budget1_accuracy"] <= 1 and e["fixed"][0]["policy"] == "backbone"
        assert next(r for r in e["fixed"] if r["policy"] == "fixed_1xk1")["accuracy"] == e["budget1_accuracy"]
    assert doc["converged"]["bank_source"] == "embedding" and "success_rate" in doc["converged"]
    assert {"total", "backbone", "workspace", "controller", "evaluate", "controls"} <= set(doc["wall_s"])
    assert (out / "recall_accuracy_vs_ops.png").stat().st_size > 0 and (out / "recall_edits.png").stat().st_size > 0
    model, meta = load_checkpoint(doc["seeds"][0]["controller_checkpoint"])
    assert meta.stage == "controller" and model.cfg.bank_shift


def test_controller_rows_equal_forward_policy():
    """The study's controller rows (one encoding per batch, rolled out at every price) equal forward_policy's
    accuracy, edits and query share at each price."""
    from prisme.studies.recall_eval import _batches, policy_rows

    model = recall_model(torch.float32).eval()
    torch.nn.init.normal_(model.controller.mlp[-1].weight, std=0.3)  # a controller that edits at some positions
    mcfg = MQARConfig(**MQ)
    rows = policy_rows(model, mcfg, 7, 32, [0.0, 0.5])
    x, y = next(iter(_batches(mcfg, 32, 7)))
    lab = y != IGNORE_INDEX
    for r in rows:
        with torch.no_grad():
            out = model.forward_policy(x, model.cfg.r_max, lambda_cost=r["lambda"])
        assert r["accuracy"] == float((out.logits.argmax(-1)[lab] == y[lab]).float().mean())
        assert r["edits_per_token"] == float(out.n_edits.double().mean())
    assert rows[0]["edits_per_token"] > rows[1]["edits_per_token"]


@pytest.mark.slow  # 20 s: `make test-slow` (and CI) run it
def test_frontier_quick_run_writes_both_families_the_verdict_and_the_router_cost(tmp_path):
    """`prisme study recall --frontier --quick`: the controls, the dense grid (every depth x width) and a PRISME size
    with its router, in the table and in the JSON layout other tools read (`frontier.dense` / `frontier.prisme`
    entries, `frontier.verdict`, `frontier.router`), with ops against one reference; the plot is written."""
    out = tmp_path / "f"
    buf = StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["study", "recall", "--frontier", "--quick", "--jobs", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = buf.getvalue()
    doc = json.loads(text[text.index("\n{") + 1:])
    f = doc["frontier"]
    cfg = RecallStudyConfig()
    assert {(e["n_layer"], e["d_model"]) for e in f["dense"]} == {(L, d) for b in cfg.frontier_dense
                                                                  for L in b["depths"] for d in b["widths"]}
    keys = {"n_layer", "d_model", "w", "ops_ratio", "accuracy", "seeds_at_95"}
    assert all(keys <= set(e) and e["w"] is None and len(e["accuracy"]) == 1 for e in f["dense"])
    assert len(f["prisme"]) == 1 and keys <= set(f["prisme"][0]) and f["prisme"][0]["w"] == cfg.family[0][1]
    ref = next(e for e in f["dense"] if (e["n_layer"], e["d_model"]) == (1, 64))
    assert abs(ref["ops_ratio"] - 1.0) < 1e-12  # the reference is the recipe's 1-layer d=64 backbone
    assert [e["ops_ratio"] for e in f["dense"]] == sorted(e["ops_ratio"] for e in f["dense"])
    assert set(f["verdict"]) == {"dense_best", "prisme_best", "ops_ratio_prisme_over_dense"}
    assert 0 < f["router"]["share_of_backbone_layer"] <= 0.10 and f["router"]["ops_per_position"] > 0
    assert "cheapest dense passing" in text and (out / "recall_frontier.png").stat().st_size > 0
    model, meta = load_checkpoint(f["prisme"][0]["checkpoints"][0])
    assert meta.stage == "router" and model.cfg.router
    buf = StringIO()  # --evaluate-only scores the same checkpoints again, training nothing: the same numbers
    with redirect_stdout(buf):
        rc = cli.main(["study", "recall", "--frontier", "--quick", "--jobs", "1", "--out", str(out), "--no-progress",
                       "--evaluate-only"])
    text = buf.getvalue()
    again = json.loads(text[text.index("\n{") + 1:])["frontier"]
    assert rc == 0 and [e["accuracy"] for e in again["dense"] + again["prisme"]] == \
        [e["accuracy"] for e in f["dense"] + f["prisme"]]
    from prisme.studies.recall import run_study

    with pytest.raises(ValueError, match="evaluate-only.*holds no checkpoint"):
        run_study(study_config({"frontier": True, "quick": True, "evaluate_only": True,
                                "out_dir": str(tmp_path / "empty")}), progress=False)


@pytest.mark.parametrize("override, field", [({"frontier_dense": [{"depths": [1], "widths": [15]}]}, "frontier_dense"),
                                             ({"frontier_dense": [{"depths": [1], "widths": []}]}, "frontier_dense"),
                                             ({"frontier_dense": [{"depths": [0], "widths": [16]}]}, "frontier_dense"),
                                             ({"frontier_dense": []}, "frontier_dense"),
                                             ({"frontier_dense": [{"depths": [1], "widths": [16], "window": 4}]},
                                              "frontier_dense"),
                                             ({"frontier_dense": [{"depths": [1], "widths": [16]},
                                                                  {"depths": [1], "widths": [16]}]}, "frontier_dense"),
                                             ({"family": [[16, -32]]}, "family"),
                                             ({"family": [[18, 32]]}, "family"),
                                             ({"family": [[16, 33]]}, "family"),
                                             ({"context_family": [[16, 32, 64, 1]]}, "context_family"),
                                             ({"context_family": [[16, 32, 64, True, 2]]}, "context_family"),
                                             ({"context_family": [{"d": 16, "w": 32, "window": 64}]},
                                              "context_family"),
                                             ({"context_family": [{"d": 16, "attn_window": 64}]}, "context_family"),
                                             ({"context_family": [{"d": 16, "w": 32, "router_token": 1}]},
                                              "context_family"),
                                             ({"context_family": []}, "context_family"),
                                             ({"context_workspace_warmup": -1}, "context_workspace_warmup"),
                                             ({"context_warmup_steps": 0}, "context_warmup_steps"),
                                             ({"context_workspace_warmup": 10, "context_warmup": False},
                                              "context_workspace_warmup"),
                                             ({"frontier_steps": 1000}, "frontier_steps")])
def test_a_bad_frontier_grid_is_a_value_error_naming_the_field_before_anything_trains(tmp_path, override, field):
    """A width the head count does not divide (or an odd head dim), an empty or non-positive entry, a workspace width
    its heads do not divide, a dense frontier trained less than the PRISME family: ValueError naming the field."""
    from prisme.studies.recall import run_study

    out = tmp_path / "f"
    quick = {} if field == "frontier_steps" else {"quick": True}  # were a check to miss, a smoke run, not the study
    with pytest.raises(ValueError, match=field):
        run_study(study_config({"frontier": True, "out_dir": str(out), "seeds": [0], "jobs": 1, **quick, **override}),
                  progress=False)
    assert not out.exists()
