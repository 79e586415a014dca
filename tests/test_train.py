"""Three-stage training on the tiny preset: each stage learns, moves only its own parameters, hands off through
checkpoints, resumes exactly, saves on Ctrl-C and stops on a non-finite loss."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from prisme import checkpoint as ckpt
from prisme.config import PrismeConfig
from prisme.data.text import TokenDataset
from prisme.model.prisme import PrismeModel
from prisme.training import objectives as objectives
from prisme.training import trainer as train_mod
from prisme.training.config import STAGES, StageConfig, load_run_config
from prisme.training.trainer import NonFiniteLossError, train_stage

REPO = Path(__file__).resolve().parents[1]
T = 32



def copy_stream(n_blocks: int, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    """Blocks of 8 tokens from a noisy bigram chain (next = 7 t + 3 + {0, 1, 2}), each followed by a copy of itself.

    A backbone learns the bigram quickly (loss ~ log 3 instead of log 63); inside the copy the exact token can be read
    from the bank, so the workspace has something to add.
    """
    g = torch.Generator().manual_seed(seed)
    first = torch.empty(n_blocks, 8, dtype=torch.long)
    first[:, 0] = torch.randint(1, vocab, (n_blocks,), generator=g)
    for i in range(1, 8):
        first[:, i] = (7 * first[:, i - 1] + 3 + torch.randint(0, 3, (n_blocks,), generator=g)) % (vocab - 1) + 1
    return torch.cat([first, first], dim=1).reshape(-1)  # [16 n_blocks]


@pytest.fixture(scope="module")
def data() -> TokenDataset:
    return TokenDataset(copy_stream(300), val_fraction=0.2, vocab_size=64)


def stage_cfg(tmp: Path, stage: str, **kw) -> StageConfig:
    base = dict(stage=stage, steps=12, batch_size=8, seq_len=T, lr=3e-3, min_lr=3e-4, warmup=2, eval_every=0,
                eval_batches=2, out_dir=str(tmp / stage), progress=False, seed=3, oracle_positions=6)
    base.update(kw)
    return StageConfig(**base)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def group_names(model, stage: str) -> set[str]:
    params = {"backbone": model.backbone_parameters, "workspace": model.workspace_parameters,
              "controller": model.controller_parameters}[stage]()
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, data) -> dict:
    """Stages 1 -> 2 -> 3 on the copy task; keeps each stage's start and end weights and its result."""
    tmp = tmp_path_factory.mktemp("pipeline")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = PrismeConfig.from_name("tiny")
    out: dict = {"tmp": tmp, "cfg": cfg}
    torch.manual_seed(3)  # a fresh stage 1 builds its model right after seeding with StageConfig.seed
    out["init"] = snapshot(PrismeModel(cfg))
    r1 = train_stage(cfg, stage_cfg(tmp, "backbone", steps=40, lr=1e-2), dataset=data)
    r2 = train_stage(None, stage_cfg(tmp, "workspace", steps=100, lr=1e-2, init_from=str(tmp / "backbone")),
                     dataset=data)
    r3 = train_stage(None, stage_cfg(tmp, "controller", steps=100, batch_size=16, oracle_positions=16,
                                     init_from=str(tmp / "workspace"), eval_batches=3), dataset=data)
    out["results"] = {"backbone": r1, "workspace": r2, "controller": r3}
    out["weights"] = {s: snapshot(ckpt.load_model(tmp / s)[0]) for s in ("backbone", "workspace", "controller")}
    torch.set_num_threads(n)
    return out


@pytest.mark.parametrize("stage", ["backbone", "workspace", "controller"])
def test_stage_changes_only_its_own_parameters(pipeline, stage):
    """After a stage, every parameter of its group has moved and every other tensor is bitwise unchanged."""
    if stage == "backbone":
        before = pipeline["init"]
    else:
        before = pipeline["weights"][{"workspace": "backbone", "controller": "workspace"}[stage]]
    after = pipeline["weights"][stage]
    model = ckpt.load_model(pipeline["tmp"] / stage)[0]
    mine = group_names(model, stage)
    assert mine, "the stage's group is empty"
    moved = {k for k in after if not torch.equal(before[k], after[k])}
    assert moved == mine, f"unexpected: {sorted(moved - mine)[:5]}, unmoved: {sorted(mine - moved)[:5]}"
    assert all(torch.isfinite(v).all() for v in after.values())


def test_backbone_keeps_learning_option_moves_the_backbone(pipeline, data, tmp_path):
    """With train_backbone_in_workspace_stage, stage 2 also moves the backbone (the group check can see a leak)."""
    init = pipeline["tmp"] / "backbone"
    train_stage(None, stage_cfg(tmp_path, "workspace", steps=2, init_from=str(init),
                                train_backbone_in_workspace_stage=True), dataset=data)
    after = snapshot(ckpt.load_model(tmp_path / "workspace")[0])
    before = pipeline["weights"]["backbone"]
    model = ckpt.load_model(init)[0]
    moved = {k for k in after if not torch.equal(before[k], after[k])}
    assert group_names(model, "backbone") <= moved and group_names(model, "workspace") <= moved
    assert not moved & group_names(model, "controller")


def test_a_backbone_trained_for_its_embedding_alone_moves_the_embedding_and_the_workspace_only(pipeline, data,
                                                                                               tmp_path):
    """`backbone_trains="embedding"`: stage 2 moves the token embedding (what an embedding bank reads) and the
    workspace; every other backbone tensor is bitwise unchanged. Negative control: the default ("all") moves them
    too; the option without the backbone joining is a ValueError naming it."""
    init = pipeline["tmp"] / "backbone"
    before = pipeline["weights"]["backbone"]
    model = ckpt.load_model(init)[0]
    emb = {"backbone.tok_emb.weight"} & set(before)
    blocks = group_names(model, "backbone") - emb
    assert emb and blocks
    moved = {}
    for trains in ("embedding", "all"):
        train_stage(None, stage_cfg(tmp_path / trains, "workspace", steps=2, init_from=str(init),
                                    train_backbone_in_workspace_stage=True, backbone_trains=trains), dataset=data)
        after = snapshot(ckpt.load_model(tmp_path / trains / "workspace")[0])
        moved[trains] = {k for k in after if not torch.equal(before[k], after[k])}
    assert moved["embedding"] == emb | group_names(model, "workspace")
    assert blocks <= moved["all"]
    with pytest.raises(ValueError, match="backbone_trains='embedding' needs train_backbone_in_workspace_stage"):
        StageConfig(stage="workspace", backbone_trains="embedding").validate()


def test_joint_training_from_scratch_starts_fresh_and_trains_backbone_and_workspace(data, tmp_path):
    """A workspace stage with train_backbone_in_workspace_stage and a model but no init_from starts from a fresh
    model seeded like a fresh stage 1 (joint training from scratch): both groups move, the controller does not, and
    the checkpoint records both as trained. Without the joint option the stage still needs stage 1's checkpoint."""
    cfg = PrismeConfig.from_name("tiny")
    torch.manual_seed(3)
    init = snapshot(PrismeModel(cfg))
    r = train_stage(cfg, stage_cfg(tmp_path, "workspace", steps=3, train_backbone_in_workspace_stage=True),
                    dataset=data)
    model, meta = ckpt.load_model(tmp_path / "workspace")
    after = snapshot(model)
    moved = {k for k in after if not torch.equal(init[k], after[k])}
    assert r.step == 3 and moved == group_names(model, "backbone") | group_names(model, "workspace")
    assert ckpt.trained_groups(meta) == {"backbone", "workspace"}
    with pytest.raises(ValueError, match="starts from the 'backbone' stage's checkpoint"):
        train_stage(cfg, stage_cfg(tmp_path / "b", "workspace", steps=3), dataset=data)


def test_each_stage_reaches_a_finite_lower_loss(pipeline):
    """Each stage ends with a finite loss; stage 1 beats uniform, stage 2 beats its frozen backbone on val."""
    r = pipeline["results"]
    assert [res.step for res in r.values()] == [40, 100, 100] and not any(res.interrupted for res in r.values())
    assert r["backbone"].val["loss"] < torch.log(torch.tensor(64.0)).item() - 0.3
    ws = r["workspace"].val
    assert ws["loss"] < ws["loss_backbone"] - 0.01, ws  # 100 steps: a small but real gain over the frozen backbone
    assert 0.0 < ws["gate0_mean"] < 1.0 and ws["s_change"] > 0 and ws["delta_ratio"] > 0
    rows = [json.loads(s) for s in (pipeline["tmp"] / "workspace" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [x for x in rows if x["split"] == "train"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "gate0_mean", "s_change", "delta_ratio"} <= train_rows[0].keys()


def test_controller_value_beats_a_constant_predictor(pipeline, data, tmp_path):
    """On held-out oracle targets the trained value head beats the best constant by 10% in MSE; untrained, it does
    not."""
    val = pipeline["results"]["controller"].val
    assert val["value_mse"] < 0.9 * val["value_mse_const"], val
    assert val["value_mse"] < val["value_mse_const_action"], val
    # negative control: a controller that has not learned (one step at lr ~ 0: its heads start at the best per-action
    # constant of one calibration batch) does not beat the constant by that margin
    r0 = train_stage(None, stage_cfg(tmp_path, "controller", steps=1, lr=1e-9, min_lr=0.0, warmup=0, batch_size=16,
                                     oracle_positions=16, init_from=str(pipeline["tmp"] / "workspace"),
                                     eval_batches=3), dataset=data)
    assert r0.val["value_mse"] > 0.97 * r0.val["value_mse_const"], r0.val


@pytest.mark.parametrize("stage", ["backbone", "workspace", "controller"])
def test_loss_decreases_on_a_repeated_batch(pipeline, tmp_path, stage):
    """Training on one fixed batch lowers that batch's loss (stage 2 and 3 under their random actions)."""
    one = TokenDataset(torch.cat([copy_stream(3, seed=9)[: T + 1], copy_stream(3, seed=10)[: T + 1]]),
                       val_fraction=0.5, vocab_size=64)
    init = {"backbone": None, "workspace": pipeline["tmp"] / "backbone", "controller": pipeline["tmp"] / "workspace"}
    seen: list[float] = []
    train_stage(pipeline["cfg"] if stage == "backbone" else None,
                stage_cfg(tmp_path, stage, steps=20, lr=1e-2, init_from=None if init[stage] is None
                          else str(init[stage])), dataset=one, callbacks=[lambda s, m: seen.append(m["objective"])])
    assert all(torch.isfinite(torch.tensor(seen)))
    first, last = sum(seen[:3]) / 3, sum(seen[-3:]) / 3
    assert last < 0.9 * first, (first, last)


def test_later_stage_without_previous_checkpoint_names_the_file(tmp_path, data):
    """Stage 2 without init_from, or with a folder lacking the weights, is a ValueError saying what to run."""
    with pytest.raises(ValueError, match="'workspace' starts from the 'backbone' stage's checkpoint.*init_from"):
        train_stage(None, stage_cfg(tmp_path, "workspace"), dataset=data)
    with pytest.raises(ValueError, match="does not exist"):
        train_stage(None, stage_cfg(tmp_path, "workspace", init_from=str(tmp_path / "nope")), dataset=data)
    half = tmp_path / "half"
    half.mkdir()
    (half / ckpt.CONFIG).write_text(PrismeConfig.from_name("tiny").to_json())
    with pytest.raises(ValueError, match=r"missing .*model\.safetensors.*prisme train --stage backbone"):
        train_stage(None, stage_cfg(tmp_path, "workspace", init_from=str(half)), dataset=data)
    assert not (tmp_path / "workspace").exists()  # nothing was written


def test_controller_stage_rejects_a_backbone_checkpoint(pipeline, tmp_path, data):
    """Stage 3 from a stage-1 checkpoint (an untrained workspace) is a ValueError naming both stages."""
    with pytest.raises(ValueError, match="'controller' needs a checkpoint of stage 'workspace'.*'backbone'"):
        train_stage(None, stage_cfg(tmp_path, "controller", init_from=str(pipeline["tmp"] / "backbone")),
                    dataset=data)


def test_existing_run_is_not_overwritten(pipeline, data):
    """Starting a stage in a folder that already holds a run, without resume, is a ValueError."""
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        train_stage(pipeline["cfg"], stage_cfg(pipeline["tmp"], "backbone"), dataset=data)


def _interrupt_at(step: int):
    def cb(s: int, metrics: dict) -> None:
        if s == step:
            raise KeyboardInterrupt

    return cb


@pytest.mark.parametrize("stage", ["backbone", "workspace", "controller"])
def test_resume_after_ctrl_c_equals_an_uninterrupted_run(pipeline, data, tmp_path, monkeypatch, stage):
    """Ctrl-C at step 3 saves a checkpoint; resuming it to step 6 gives bitwise the weights of a straight run."""
    init = {"backbone": None, "workspace": pipeline["tmp"] / "backbone", "controller": pipeline["tmp"] / "workspace"}
    cfg = pipeline["cfg"] if stage == "backbone" else None
    kw = dict(steps=6, init_from=None if init[stage] is None else str(init[stage]))
    straight = train_stage(cfg, stage_cfg(tmp_path / "a", stage, **kw), dataset=data)
    cut = train_stage(cfg, stage_cfg(tmp_path / "b", stage, **kw), dataset=data, callbacks=[_interrupt_at(3)])
    assert cut.interrupted and cut.step == 3 and cut.checkpoint.name == "ckpt_000003"
    assert (cut.checkpoint / ckpt.OPTIMIZER).is_file()
    resumed = train_stage(cfg, stage_cfg(tmp_path / "b", stage, resume=True, **kw), dataset=data)
    assert resumed.step == 6 and not resumed.interrupted
    a = ckpt.load_model(straight.checkpoint)[0].state_dict()
    b = ckpt.load_model(resumed.checkpoint)[0].state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # negative control: a resume that forgets the generator states draws other batches and ends elsewhere
    monkeypatch.setattr(train_mod, "restore_rng_state", lambda gens, state, source=None: None)
    bad = train_stage(cfg, stage_cfg(tmp_path / "c", stage, **kw), dataset=data, callbacks=[_interrupt_at(3)])
    bad = train_stage(cfg, stage_cfg(tmp_path / "c", stage, resume=True, **kw), dataset=data)
    c = ckpt.load_model(bad.checkpoint)[0].state_dict()
    assert [k for k in a if not torch.equal(a[k], c[k])] != []


def test_resume_with_the_prev_token_probe_equals_an_uninterrupted_run(pipeline, data, tmp_path):
    """aux_prev_token's probe is checkpointed: Ctrl-C at step 3 then resume ends bitwise where a straight run ends;
    a checkpoint stripped of the probe (the negative control) resumes with a fresh probe and ends elsewhere."""
    kw = dict(steps=6, init_from=str(pipeline["tmp"] / "backbone"), train_backbone_in_workspace_stage=True,
              aux_prev_token=0.5)
    straight = train_stage(None, stage_cfg(tmp_path / "a", "workspace", **kw), dataset=data)
    a = ckpt.load_model(straight.checkpoint)[0].state_dict()
    ends = {}
    for strip in (False, True):
        out = tmp_path / f"b{strip}"
        cut = train_stage(None, stage_cfg(out, "workspace", **kw), dataset=data, callbacks=[_interrupt_at(3)])
        if strip:
            opt_file = cut.checkpoint / ckpt.OPTIMIZER
            state = torch.load(opt_file, weights_only=False)
            assert "prev_probe.weight" in state.pop("objective")
            torch.save(state, opt_file)  # as if written without the probe: its recorded checksum follows
            meta_file = cut.checkpoint / ckpt.STATE
            meta = json.loads(meta_file.read_text())
            meta["optimizer_sha256"] = hashlib.sha256(opt_file.read_bytes()).hexdigest()
            meta_file.write_text(json.dumps(meta))
        resumed = train_stage(None, stage_cfg(out, "workspace", resume=True, **kw), dataset=data)
        b = ckpt.load_model(resumed.checkpoint)[0].state_dict()
        ends[strip] = [k for k in a if not torch.equal(a[k], b[k])]
    assert ends[False] == [] and ends[True] != []


def test_resume_after_a_crash_logs_each_step_once(pipeline, data, tmp_path, monkeypatch):
    """A run that died after logging steps past its last checkpoint, once resumed, has one train row per step (the
    rows after the checkpoint are replaced); keeping the stale rows (the negative control) duplicates steps 4-6."""
    cfg = pipeline["cfg"]

    def train_rows(out: Path) -> list[int]:
        rows = [json.loads(line) for line in (out / "backbone" / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if r.get("split") == "train"]

    for drop in (True, False):
        out = tmp_path / str(drop)
        kw = dict(steps=6, ckpt_every=3, log_every=1, keep_last=0)
        train_stage(cfg, stage_cfg(out, "backbone", **kw), dataset=data)
        run = out / "backbone"
        shutil.rmtree(run / ckpt.checkpoint_name(6))  # the crash: steps 4-6 logged, their checkpoint never written
        (run / ckpt.LATEST).write_text(ckpt.checkpoint_name(3))
        if not drop:
            monkeypatch.setattr(train_mod, "drop_rows_after", lambda path, step: None)
        train_stage(cfg, stage_cfg(out, "backbone", resume=True, **kw), dataset=data)
        steps = train_rows(out)
        if drop:
            assert steps == [1, 2, 3, 4, 5, 6]
        else:
            assert steps == [1, 2, 3, 4, 5, 6, 4, 5, 6]


def test_real_sigint_stops_at_the_step_boundary_and_saves(data, tmp_path):
    """A SIGINT delivered mid-run (the Ctrl-C handler) ends the run after the current step with a checkpoint."""
    import os
    import signal

    def ctrl_c(step: int, metrics: dict) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:  # a shell that started us in the background ignores SIGINT: Ctrl-C as a terminal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # would deliver it
        before = signal.default_int_handler
    r = train_stage(PrismeConfig.from_name("tiny"), stage_cfg(tmp_path, "backbone", steps=6), dataset=data,
                    callbacks=[ctrl_c])
    assert r.interrupted and r.step == 2 and r.checkpoint.name == "ckpt_000002"
    assert ckpt.read_meta(tmp_path / "backbone").step == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handler was restored


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(data, tmp_path, monkeypatch):
    """A NaN loss at step 5 raises NonFiniteLossError naming the step-4 checkpoint, which stays the newest."""
    calls = {"n": 0}
    forward = objectives.BackboneObjective.forward

    def poisoned(self, *args):
        loss, stats = forward(self, *args)
        calls["n"] += 1
        return (loss * float("nan"), stats) if calls["n"] == 5 else (loss, stats)

    monkeypatch.setattr(objectives.BackboneObjective, "forward", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss.*step 5.*ckpt_000004"):
        train_stage(PrismeConfig.from_name("tiny"), stage_cfg(tmp_path, "backbone", ckpt_every=2, keep_last=0),
                    dataset=data)
    run = tmp_path / "backbone"
    assert ckpt.latest_checkpoint(run).name == "ckpt_000004"
    assert sorted(p.name for p in run.glob("ckpt_*")) == ["ckpt_000002", "ckpt_000004"]
    model, meta = ckpt.load_model(run)
    assert meta.step == 4 and all(torch.isfinite(p).all() for p in model.parameters())
    rows = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "non_finite" and rows[-1]["step"] == 4


def test_run_configs_in_repo_load():
    """Every prisme/configs/*.json run config parses into a valid StageConfig (and model config where given); the study
    settings (*_study.json) parse into theirs."""
    from prisme.studies.recall_setup import study_config

    files = sorted(f for f in (REPO / "prisme" / "configs").glob("*.json") if not f.name.endswith("_study.json"))
    assert files, "no example configs"
    assert study_config({}).seeds == [0, 1, 2, 3, 4]
    stages = set()
    for f in files:
        model_cfg, scfg = load_run_config(f)
        stages.add(scfg.stage)
        assert model_cfg is None or model_cfg.validate() is model_cfg
    assert stages == set(STAGES)  # every stage of the registry has a recipe here


def test_backbone_lr_gives_the_learning_backbone_its_own_schedule(pipeline, data, tmp_path):
    """backbone_lr=0 keeps every backbone weight bitwise while the workspace moves; backbone_lr > 0 moves it."""
    init = pipeline["tmp"] / "backbone"
    before = pipeline["weights"]["backbone"]
    model = ckpt.load_model(init)[0]
    moved = {}
    for blr in (0.0, 1e-3):
        out = tmp_path / f"blr{blr}"
        r = train_stage(None, stage_cfg(out, "workspace", steps=3, init_from=str(init), backbone_lr=blr,
                                        train_backbone_in_workspace_stage=True), dataset=data)
        after = snapshot(ckpt.load_model(r.checkpoint)[0])
        moved[blr] = {k for k in after if not torch.equal(before[k], after[k])}
        rows = [json.loads(line) for line in (out / "workspace" / "metrics.jsonl").read_text().splitlines()]
        lrs = [(row["lr_backbone"], row["lr"]) for row in rows if "lr_backbone" in row]
        assert lrs and all(0 <= b <= blr < lr for b, lr in lrs), lrs
    assert not moved[0.0] & group_names(model, "backbone") and group_names(model, "workspace") <= moved[0.0]
    assert group_names(model, "backbone") <= moved[1e-3]  # negative control: the same run with a backbone lr


def test_isolated_backbone_follows_the_matched_baseline_exactly(pipeline, data, tmp_path):
    """With workspace_grad_to_backbone=False the stage-2 backbone ends bitwise equal to a backbone-stage run on the
    same batches and schedule (the matched baseline), while the workspace learns; with the workspace's loss reaching
    the backbone (the negative control) the two differ."""
    init = str(pipeline["tmp"] / "backbone")
    sched = dict(steps=6, lr=2e-3, min_lr=2e-4, warmup=2, init_from=init)
    matched = train_stage(None, stage_cfg(tmp_path / "m", "backbone", **sched), dataset=data)
    ref = ckpt.load_model(matched.checkpoint)[0].backbone.state_dict()
    ends = {}
    for isolate in (True, False):
        r = train_stage(None, stage_cfg(tmp_path / f"iso{isolate}", "workspace", train_backbone_in_workspace_stage=True,
                                        workspace_grad_to_backbone=not isolate, backbone_lr=2e-3, backbone_min_lr=2e-4,
                                        **{**sched, "lr": 5e-3}), dataset=data)
        model = ckpt.load_model(r.checkpoint)[0]
        ends[isolate] = max((model.backbone.state_dict()[k] - v).abs().max().item() for k, v in ref.items())
        moved = model.readout.U.weight.abs().max().item()
        assert moved > 0, "the workspace did not learn"
    assert ends[True] == 0.0, ends
    assert ends[False] > 1e-6, ends


def test_bad_stage_configs_are_clear_errors(tmp_path, data):
    """Unknown fields, bad values and an indivisible batch are ValueErrors naming the field."""
    with pytest.raises(ValueError, match="unknown StageConfig field"):
        StageConfig.from_dict({"stage": "backbone", "stpes": 3})
    with pytest.raises(ValueError, match="stage must be one of"):
        StageConfig(stage="decoder").validate()
    with pytest.raises(ValueError, match="min_lr"):
        StageConfig(lr=1e-3, min_lr=1e-2).validate()
    with pytest.raises(ValueError, match="backbone_min_lr"):
        StageConfig(backbone_lr=1e-4, backbone_min_lr=1e-3).validate()
    with pytest.raises(ValueError, match="backbone_lr"):
        StageConfig(backbone_lr=float("nan")).validate()
    with pytest.raises(ValueError, match="backbone_lr / backbone_min_lr need"):
        StageConfig(stage="workspace", backbone_lr=1e-3).validate()
    with pytest.raises(ValueError, match="workspace_grad_to_backbone=False needs"):
        StageConfig(stage="workspace", workspace_grad_to_backbone=False).validate()
    with pytest.raises(ValueError, match="divisible by grad_accum"):
        train_stage(PrismeConfig.from_name("tiny"), stage_cfg(tmp_path, "backbone", batch_size=6, grad_accum=4),
                    dataset=data)
    with pytest.raises(ValueError, match="seq_len=65 exceeds"):
        train_stage(PrismeConfig.from_name("tiny"), stage_cfg(tmp_path, "backbone", seq_len=65), dataset=data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stage": "backbone", "model": {"preset": "tiny", "n_slots": 3}}))
    with pytest.raises(ValueError, match="n_slots"):
        load_run_config(bad)
    assert not (tmp_path / "backbone").exists()


def test_bf16_autocast_stages_track_float32(tmp_path, data):
    """The backbone and workspace stages under bf16 autocast end within 0.02 nats of the float32 runs."""
    cfg = PrismeConfig.from_name("tiny")
    f32 = train_stage(cfg, stage_cfg(tmp_path / "f32", "backbone", steps=10), dataset=data)
    bf16 = train_stage(cfg, stage_cfg(tmp_path / "bf16", "backbone", steps=10, dtype="bfloat16"), dataset=data)
    assert abs(bf16.val["loss"] - f32.val["loss"]) < 0.02
    assert ckpt.load_model(bf16.checkpoint)[0].backbone.tok_emb.weight.dtype == torch.float32  # fp32 master weights
    ws = {dt: train_stage(None, stage_cfg(tmp_path / f"ws_{dt}", "workspace", steps=5, dtype=dt,
                                          init_from=str(f32.checkpoint)), dataset=data)
          for dt in ("float32", "bfloat16")}
    assert abs(ws["bfloat16"].val["loss"] - ws["float32"].val["loss"]) < 0.02


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    """lr rises linearly over the warm-up, peaks at lr, and ends at min_lr."""
    s = StageConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    lrs = [train_mod.lr_at(i, s) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert train_mod.lr_at(100, s) == pytest.approx(0.1)


def test_demo_rejects_bad_settings_before_training(tmp_path):
    """A zero scale or zero evaluation batches is a ValueError before any run folder is written."""
    from prisme.studies.demo import DemoOptions, run_demo

    with pytest.raises(ValueError, match="scale"):
        run_demo(tmp_path / "a", DemoOptions(scale=0, progress=False))
    with pytest.raises(ValueError, match="eval_batches"):
        run_demo(tmp_path / "b", DemoOptions(eval_batches=0, progress=False))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_demo_pipeline_writes_every_output(tmp_path):
    """The demo's glue on a byte-level tiny model (both parts' tasks in one process: the reference's PRISME member on
    a short long-context task, quick; stage 1, the deeper and matched backbones, each bank source's stages 2-3 and
    evaluation on validation and the held-out text; then a sample) writes the reports, plots and summary; its recall
    lines follow from this run and the reference, its text verdicts from the intervals."""
    from prisme.studies.demo import DemoOptions, load_reference, run_demo

    cfg = PrismeConfig.from_name("tiny", vocab_size=256)
    held = tmp_path / "held_out.txt"
    held.write_text("Abasement, n. A decent and customary mental attitude in the presence of wealth. " * 6)
    options = DemoOptions(scale=0.01, eval_batches=1, progress=False, model_cfg=cfg, jobs=1,
                          sources=["residual", "embedding"], held_out=str(held), recall_seeds=[0], recall_context=96)
    summary = run_demo(tmp_path / "demo", options)
    run = tmp_path / "demo"
    assert {p.name for p in run.iterdir()} >= {"recall", "text", "sample.txt", "summary.json", "report.txt"}
    recall = json.loads((run / "recall" / "recall.json").read_text())
    ref = load_reference()
    (r,) = recall["runs"]
    assert recall["T"] == 96 and r["seed"] == 0 and r["study_accuracy"] is None  # another length: no seed to repeat
    assert r["ops_ratio"] == r["ops_ratio"] > 0 and 0 <= r["accuracy"] <= 1 and r["passes"] == (r["accuracy"] >= 0.95)
    trained = list((run / "recall" / "frontier" / "T96").iterdir())
    assert [p.name for p in trained] == ["prisme_d12_w32_ks_win64_tok_seed0"]  # the confirmed member, nothing else
    assert ref["member"] == {"d": 12, "w": 32, "attn_window": 64, "key_shift": True, "router_token": True}
    verdict = ref["context"]["confirmation"]["verdict"]  # the member the confirmation on fresh seeds confirmed
    assert ref["best"]["name"] == verdict["prisme_name"] and ref["best"]["seeds_at_95"] == 5
    lines = summary["lines"]
    assert len(lines) <= 25 and lines == summary["recall"]["lines"] + lines[len(summary["recall"]["lines"]):]
    assert f"accuracy {r['accuracy']:.3f} at {r['ops_ratio']:.3f}x ops" in lines[1]
    win = ref["context"]["dense_best"]  # the recorded verdict: the cheapest passing dense model, PRISME's share of it
    assert any(f"{win['name']} at {win['ops_ratio']:.3f}x" in v and f"needs {ref['context']['ratio']:.3f}x its ops"
               in v and ref["context"]["prisme_best"]["name"].split(",")[0] in v for v in lines)
    report = (run / "report.txt").read_text()
    assert all(e["name"] in report for e in ref["context"]["entries"]) and "== over the training seeds" in report
    text = run / "text" / "seed1337"
    deeper = f"L2_d{cfg.d_model}"  # the demo's one frontier model: one layer deeper
    assert {"1_backbone", "3_backbone_matched", "frontier", "residual", "embedding"} <= {p.name for p in text.iterdir()}
    doc = json.loads((run / "text" / "text.json").read_text())
    assert list(doc["seeds"]) == ["1337"] and doc["frontier"] == [deeper]
    one = doc["seeds"]["1337"]
    for src in ("residual", "embedding"):
        for split in ("val", "held_out"):
            rows = one["sources"][src][split]["rows"]
            policies = {r["policy"] for r in rows}
            assert {"backbone", "backbone+matched", deeper} <= policies
            assert any(p.startswith("equal_edits") for p in policies)
            assert all(r["delta_vs_matched"] is not None for r in rows)
            assert all(r["frontier_gap"] for r in rows if r["family"] in ("fixed", "controller"))
        assert (text / src / "pareto_held_out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(text / src / "pareto_held_out.png") in summary["plots"]
    assert [v for v in doc["verdicts"] if "closest to the dense frontier" in v] == [
        v.strip() for v in lines if "closest to the dense frontier" in v]
    held = one["sources"]["residual"]["held_out"]
    assert held["n_sequences"] == held["n_tokens"] // doc["stages"]["workspace"]["seq_len"]  # all of the text
    steps = one["training"]
    assert steps[f"frontier:{deeper}"]["tokens"] >= steps["backbone"]["tokens"] + sum(  # PRISME's stages together
        steps["source:residual"][k]["tokens"] for k in ("workspace", "controller"))
    assert summary["sample"]["temperature"] == 0.8 and "--temperature 0.8 --top-k 20" in summary["sample"]["command"]
    assert (run / "sample.txt").read_text().startswith(summary["sample"]["prompt"] + summary["sample"]["text"])
    with pytest.raises(ValueError, match="holds a demo run with other settings"):
        run_demo(run, DemoOptions(scale=0.01, model_cfg=cfg))
    again = run_demo(run, options)  # the same settings: continued, nothing trained again
    assert again["text"]["verdicts"] == summary["text"]["verdicts"] and again["recall"]["runs"] == recall["runs"]
    assert again["sample"]["text"] == summary["sample"]["text"]  # the sample is seeded
    assert again["wall_s"]["total"] < summary["wall_s"]["total"]


def test_the_demo_names_a_missing_or_malformed_frontier_reference_before_training(tmp_path):
    """The recall part reads the recorded frontier first: a missing or malformed file is a ValueError naming it, and
    no run folder is written."""
    from prisme.studies.demo import DemoOptions, run_demo

    bad = tmp_path / "ref.json"
    bad.write_text(json.dumps({"contexts": [{"T": 1024}]}))
    for path in (bad, tmp_path / "absent.json"):
        with pytest.raises(ValueError, match=f"frontier reference {path}"):
            run_demo(tmp_path / "run", DemoOptions(reference=path, progress=False))
    assert not (tmp_path / "run").exists()


def test_aux_prev_token_adds_the_probe_ce_on_the_previous_token(data):
    """aux_prev_token adds w x CE(probe(H[t]), token t-1) to the stage-2 loss, and only with the backbone learning."""
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny")).double()
    x, y = data.batch("train", 4, T, torch.Generator().manual_seed(1))
    base = StageConfig(stage="workspace", train_backbone_in_workspace_stage=True)
    objs = {w: objectives.WorkspaceObjective(model, base.replace(aux_prev_token=w)).double() for w in (0.0, 0.5)}
    ex = objs[0.0].sample(x, y, torch.Generator().manual_seed(2))
    loss = {w: o(x, y, ex, o.denominators(x, y, ex))[0] for w, o in objs.items()}
    H = model.backbone(x)  # [4, T, d]
    logits = objs[0.5].prev_probe(H[:, 1:])  # [4, T-1, V]
    want = 0.5 * torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, :-1].flatten())
    # the trainer's CE runs in float32 (float64 weights): agree to float32 rounding of losses ~4
    torch.testing.assert_close(loss[0.5] - loss[0.0], want.float(), rtol=0, atol=1e-5)
    # negative control: the same probe aimed at the current token t is a different number
    wrong = 0.5 * torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    assert abs((wrong - want).detach().item()) > 1e-3
    with pytest.raises(ValueError, match="aux_prev_token"):
        StageConfig(stage="workspace", aux_prev_token=1.0).validate()


def test_demo_stage_configs_are_the_recipe_files():
    """The demo and the text study read prisme/configs/demo_*.json (what `prisme train --config` runs): same steps, lr,
    budgets and objectives; only the folders, the seed and a --scale differ."""
    from prisme.io import CONFIG_DIR
    from prisme.training.config import DEMO_CONFIGS, demo_stage_configs

    st = demo_stage_configs(Path("/tmp/run"), seed=5)
    for name, file in DEMO_CONFIGS.items():
        _, want = load_run_config(CONFIG_DIR / file)
        got = st[name]
        for f in ("stage", "lr", "min_lr", "batch_size", "max_budget", "deep_supervision", "oracle_positions",
                  "p_dense"):
            assert getattr(got, f) == getattr(want, f), (name, f)
        if name != "matched":
            assert got.steps == want.steps
        assert got.seed == 5 and got.out_dir.startswith("/tmp/run/")
    assert st["controller"].max_budget == st["workspace"].max_budget  # the controller trains for the same budgets
    small = demo_stage_configs(Path("/tmp/run"), scale=0.1)
    assert small["backbone"].steps == round(0.1 * st["backbone"].steps)
