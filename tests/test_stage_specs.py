"""`StageSpec` owns its stage (prisme/training/stages.py): each spec field drives what the stage does, the model's
parameter groups partition its parameters under every config option, the checkpoint layer's stage tables follow the
specs, and no module outside the spec table compares a stage's name. Each check has a negative control."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_train import copy_stream, snapshot, stage_cfg

from prisme import checkpoint as ckpt
from prisme import rebase as rebase_mod
from prisme.config import PRESETS, PrismeConfig
from prisme.data.text import TokenDataset
from prisme.model.prisme import PrismeModel
from prisme.training.config import StageConfig
from prisme.training.optim import group_lrs, make_optimizer, stage_parameters
from prisme.training.resume import check_resumable, load_start
from prisme.training.stages import STAGE_SPECS, STAGES
from prisme.training.trainer import train_stage

PACKAGE = Path(__file__).resolve().parent.parent / "prisme"
ROUTER = dict(router=True, router_ngram=1, bank_shift=True)
# every option that adds or removes a top-level module: the workspace, the router, the source bank's terms and shift,
# the controller's own input (as tests/test_contracts.py's source options)
OPTIONS = {
    "no_workspace": dict(use_workspace=False),
    "seed": {},
    "router": ROUTER,
    "embedding": dict(bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True,
                      controller_entropy=True),
    "two_sources": dict(bank_source="residual+embedding", query_source="layer1", bank_shift=True),
    "two_queries": dict(bank_source="layer1", query_source="residual+embedding", controller_source="layer1"),
    "copy": dict(copy_head=True),
    "copy_dense": dict(copy_head=True, use_workspace=False),
}
SMALL = dict(steps=2, batch_size=4, seq_len=16, eval_batches=1, oracle_positions=4, warmup=1)


@pytest.fixture(scope="module")
def data() -> TokenDataset:
    return TokenDataset(copy_stream(120), val_fraction=0.2, vocab_size=64)


def names_in(model: PrismeModel, groups: tuple[str, ...]) -> set[str]:
    """The parameter names of `groups` (each parameter under its first name, as the state dict has it)."""
    ids = {id(p) for g in groups for p in model.parameter_group(g)}
    return {n for n, p in model.named_parameters() if id(p) in ids}


# ------------------------------------------------------------------------------------------------ parameter groups
def models_under_every_option():
    cfgs = [PrismeConfig.from_name("tiny", **kw) for kw in OPTIONS.values()]
    cfgs += [PrismeConfig.from_name(name) for name in PRESETS if name not in ("prisme_103m", "prisme_459m")]
    with torch.device("meta"):  # the big presets' shapes, without their memory
        cfgs += [PrismeConfig.from_name(name) for name in ("prisme_103m", "prisme_459m")]
        big = [PrismeModel(c) for c in cfgs[-2:]]
    return [PrismeModel(c) for c in cfgs[:-2]] + big


def test_parameter_groups_partition_the_model_under_every_config_option():
    """Every parameter is in exactly one group under every option; the backbone, controller (P_ctrl too) and router
    groups are their modules'; every name GROUP_OF declares is registered by some config (none is stale)."""
    registered = set()
    for model in models_under_every_option():
        model.check_parameter_groups()
        groups = dict(model.parameter_groups())
        ids = [id(p) for ps in groups.values() for p in ps]
        assert len(ids) == len(set(ids)) == len(list(model.parameters())), model.cfg.name
        assert {id(p) for p in groups["backbone"]} == {id(p) for p in model.backbone.parameters()}
        ctrl = [*model.controller.parameters(), *model.P_ctrl.parameters()] if model.cfg.controller_terms else \
            list(model.controller.parameters()) if model.cfg.use_workspace else []
        assert {id(p) for p in groups["controller"]} == {id(p) for p in ctrl}
        router = list(model.router.parameters()) if model.cfg.router else []
        assert {id(p) for p in groups["router"]} == {id(p) for p in router}
        assert bool(groups["workspace"]) == model.cfg.use_workspace
        assert {id(p) for p in groups["copy"]} == {id(p) for p in (model.copy.parameters() if model.cfg.copy_head
                                                                    else ())}
        registered |= {n.split(".")[0] for n, _ in model.named_parameters()}
    assert registered == set(PrismeModel.GROUP_OF)


class _Extra(PrismeModel):
    def __init__(self, cfg: PrismeConfig):
        super().__init__(cfg)
        self.extra = nn.Linear(4, 4)  # a top-level module the class does not declare


def test_negative_control_an_undeclared_top_level_module_fails_loudly():
    """A module left out of GROUP_OF is a ValueError naming it (from the check, every group and the stage's
    parameters), not a silent member of the workspace; declared, the same model passes."""
    model = _Extra(PrismeConfig.from_name("tiny"))
    for call in (model.check_parameter_groups, model.workspace_parameters, lambda: dict(model.parameter_groups()),
                 lambda: stage_parameters(model, StageConfig(stage="workspace"))):
        with pytest.raises(ValueError, match="'extra' is in no parameter group"):
            call()
    declared = type("Declared", (_Extra,), {"GROUP_OF": {**PrismeModel.GROUP_OF, "extra": "workspace"}})
    declared(PrismeConfig.from_name("tiny")).check_parameter_groups()


def test_negative_control_a_parameter_in_two_groups_or_a_group_outside_groups_fails():
    """One module registered under names of two groups, or GROUP_OF naming a group outside GROUPS, breaks the
    partition."""
    shared = type("Shared", (PrismeModel,), {"GROUP_OF": {**PrismeModel.GROUP_OF, "alias": "controller"}})
    model = shared(PrismeConfig.from_name("tiny"))
    model.alias = model.readout  # the readout's parameters, again, under a controller name
    with pytest.raises(ValueError, match="belongs to one group"):
        model.check_parameter_groups()
    lost = type("Lost", (PrismeModel,), {"GROUP_OF": {**PrismeModel.GROUP_OF, "readout": "readouts"}})
    with pytest.raises(ValueError, match="do not add up"):
        lost(PrismeConfig.from_name("tiny")).check_parameter_groups()


# ------------------------------------------------------------------------------------ what a stage trains and moves
@pytest.fixture(scope="module")
def runs(tmp_path_factory, data) -> dict:
    """backbone -> workspace -> controller and router, and the workspace stage with the backbone learning, on a tiny
    router model: each run's start and end weights."""
    tmp = tmp_path_factory.mktemp("specs")
    cfg = PrismeConfig.from_name("tiny", **ROUTER)
    torch.manual_seed(3)  # a fresh stage 1 seeds with StageConfig.seed right before building its model
    out = {"init": snapshot(PrismeModel(cfg)), "tmp": tmp}
    plan = [("backbone", "backbone", None, {}), ("workspace", "workspace", "backbone", {}),
            ("joint", "workspace", "backbone", dict(train_backbone_in_workspace_stage=True, aux_prev_token=0.5)),
            ("controller", "controller", "workspace", {}), ("router", "router", "workspace", {})]
    for run, stage, start, kw in plan:
        scfg = stage_cfg(tmp, stage, out_dir=str(tmp / run), init_from=start and str(tmp / start), **SMALL, **kw)
        out[run] = (scfg, train_stage(cfg if start is None else None, scfg, dataset=data))
    return out


@pytest.mark.parametrize("run", ["backbone", "workspace", "joint", "controller", "router"])
def test_the_spec_trained_groups_are_exactly_what_a_training_step_moves(runs, run):
    """Every parameter of `StageConfig.trained_groups` moved and every other tensor is bitwise unchanged; the value
    scale is calibrated (and checkpointed) exactly in the stages whose spec says `calibrates_values`."""
    scfg, res = runs[run]
    before = runs["init"] if scfg.init_from is None else snapshot(ckpt.load_model(scfg.init_from)[0])
    model, meta = ckpt.load_model(res.checkpoint)
    after = snapshot(model)
    moved = {k for k in after if not torch.equal(before[k], after[k])}
    assert moved == names_in(model, scfg.trained_groups)
    assert moved and set(meta.extra["trained_groups"]) >= set(scfg.trained_groups)
    assert ("value_scale" in meta.extra) == scfg.spec.calibrates_values
    assert ("loss_prev_token" in res.train) == (scfg.spec.prev_token_probe and scfg.aux_prev_token > 0)


def test_negative_control_a_spec_without_backbone_joins_leaves_the_backbone_frozen(runs, data, monkeypatch):
    """The same joint run under a workspace spec whose `backbone_joins` is False: the backbone stays bitwise (the
    real spec moved it), so the trained parameters come from the spec and not from the option alone."""
    spec = dataclasses.replace(STAGE_SPECS["workspace"], backbone_joins=False)
    monkeypatch.setitem(STAGE_SPECS, "workspace", spec)
    scfg = runs["joint"][0].replace(out_dir=str(runs["tmp"] / "frozen"), aux_prev_token=0.0)
    res = train_stage(None, scfg, dataset=data)
    before = snapshot(ckpt.load_model(scfg.init_from)[0])
    model, _ = ckpt.load_model(res.checkpoint)
    moved = {k for k, v in snapshot(model).items() if not torch.equal(before[k], v)}
    assert moved == names_in(model, ("workspace",)) and not moved & names_in(model, ("backbone",))
    joint = snapshot(ckpt.load_model(runs["joint"][1].checkpoint)[0])
    assert any(not torch.equal(before[k], joint[k]) for k in names_in(model, ("backbone",)))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("joins", [False, True])
def test_the_optimizer_groups_follow_the_spec(stage, joins):
    """The optimizer holds the stage's groups' parameters and nothing else, main kind first, and a "backbone" kind
    with its own lr exactly when the backbone joins the stage (`StageConfig.backbone_joins`)."""
    from prisme.training.objectives import BackboneObjective

    model = PrismeModel(PrismeConfig.from_name("tiny", **ROUTER))
    scfg = StageConfig(stage=stage, train_backbone_in_workspace_stage=joins, backbone_lr=1e-3 if joins else None)
    params = stage_parameters(model, scfg)
    assert [id(p) for p in params] == [id(p) for g in scfg.trained_groups for p in model.parameter_group(g)]
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    opt = make_optimizer(BackboneObjective(model, scfg), scfg)
    kinds = [g["kind"] for g in opt.param_groups]
    assert kinds == ["main", "main"] + (["backbone", "backbone"] if scfg.backbone_joins else [])
    assert scfg.backbone_joins == (joins and STAGE_SPECS[stage].backbone_joins)
    assert set(group_lrs(scfg)) == {"main"} | ({"backbone"} if scfg.backbone_joins else set())
    assert scfg.may_start_fresh == ("backbone" in scfg.trained_groups)  # a stage starts fresh iff it trains H


# ------------------------------------------------------------------------------------ where a stage starts from
@pytest.mark.parametrize("stage", STAGES)
def test_may_start_fresh_and_accepts_init_decide_load_start(stage, tmp_path):
    """No init_from: a fresh model exactly where `may_start_fresh`, else the error names the spec's previous stage;
    init_from a checkpoint of each stage: loaded exactly where the spec `accepts` it."""
    spec, cfg = STAGE_SPECS[stage], PrismeConfig.from_name("tiny", **ROUTER)
    for joins in (False, True):
        scfg = StageConfig(stage=stage, train_backbone_in_workspace_stage=joins, out_dir=str(tmp_path / f"f{joins}"))
        if spec.may_start_fresh(joins):
            model, meta = load_start(cfg, scfg)
            assert meta is None and isinstance(model, PrismeModel)
        else:
            with pytest.raises(ValueError, match=f"starts from the {spec.previous!r} stage's checkpoint"):
                load_start(cfg, scfg)
    src = PrismeModel(cfg)
    for other in (*STAGES, "export"):
        path = ckpt.save_checkpoint(tmp_path / other / "ckpt_000001", src,
                                    ckpt.TrainingState(stage=other, step=1, optimizer_state={}))
        scfg = StageConfig(stage=stage, init_from=str(path), out_dir=str(tmp_path / f"from_{other}"))
        if spec.accepts(other):
            assert load_start(None, scfg)[1].stage == other
        else:
            with pytest.raises(ValueError, match=f"needs a checkpoint of stage {spec.previous!r}"):
                load_start(None, scfg)
        meta = ckpt.load_checkpoint(path, load_optimizer=True)[1]
        if spec.owns(other):  # a resume continues a checkpoint of its own stage only
            check_resumable(meta, StageConfig(stage=stage, steps=200), tmp_path)
        else:
            with pytest.raises(ValueError, match="cannot resume it as stage"):
                check_resumable(meta, StageConfig(stage=stage, steps=200), tmp_path)


def test_uses_workspace_and_needs_are_checked_before_training(tmp_path, data):
    """A stage whose spec uses the workspace refuses a model without one, one that needs the router a model without
    it, before anything is written; every other stage trains a step from the same checkpoint."""
    for i, (cfg, bad) in enumerate(((PrismeConfig.from_name("tiny", use_workspace=False), "a model with a workspace"),
                                    (PrismeConfig.from_name("tiny"), "trains the model's router"))):
        path = ckpt.save_checkpoint(tmp_path / f"m{i}" / "ckpt_000001", PrismeModel(cfg),
                                    ckpt.TrainingState(stage="workspace", step=1))
        for stage, spec in STAGE_SPECS.items():
            scfg = stage_cfg(tmp_path, stage, out_dir=str(tmp_path / f"o{i}" / stage), init_from=str(path), **SMALL)
            if spec.uses_workspace and not cfg.use_workspace or spec.needs and not getattr(cfg, spec.needs):
                lacks = bad if spec.uses_workspace and not cfg.use_workspace or spec.needs == "router" else \
                    f"trains the model's {spec.needs}"
                with pytest.raises(ValueError, match=lacks):
                    train_stage(None, scfg, dataset=data)
                assert not Path(scfg.out_dir).exists()
            else:
                assert train_stage(None, scfg.replace(steps=1), dataset=data).step == 1
    assert not STAGE_SPECS["backbone"].uses_workspace and STAGE_SPECS["router"].needs == "router"


def test_the_prev_token_probe_is_the_specs(monkeypatch):
    """The aux_prev_token probe exists where the spec trains it; the same settings under a spec without it have none."""
    model = PrismeModel(PrismeConfig.from_name("tiny"))
    scfg = StageConfig(stage="workspace", train_backbone_in_workspace_stage=True, aux_prev_token=0.5)
    assert hasattr(scfg.spec.objective(model, scfg), "prev_probe")
    monkeypatch.setitem(STAGE_SPECS, "workspace", dataclasses.replace(STAGE_SPECS["workspace"], prev_token_probe=False))
    assert not hasattr(scfg.spec.objective(model, scfg), "prev_probe")


# ------------------------------------------------------------------------------------ rebase and checkpoint tables
def test_rebase_keeps_the_spec_groups_and_writes_the_previous_stage(runs, tmp_path):
    """`--rebase` keeps `rebase_keeps` and writes a checkpoint of the stage the spec starts from (`REBASES`); the
    first stage has nothing to keep and refuses; every kept tuple is the groups its previous stages trained."""
    from prisme.training.cli import rebased_start

    cfg = PrismeConfig.from_name("tiny", **ROUTER, controller_entropy=True)
    for stage, spec in STAGE_SPECS.items():
        start = runs["tmp"] / ("workspace" if spec.previous == "workspace" else "backbone")
        scfg = StageConfig(stage=stage, init_from=str(start), out_dir=str(tmp_path / stage), seed=2,
                           dataset="mqar")  # token ids, as the runs were trained on (a rebase keeps the tokenizer)
        if not spec.rebase_keeps:
            assert spec.is_first
            with pytest.raises(ValueError, match="a stage after the backbone"):
                rebased_start(scfg, cfg)
            continue
        assert rebase_mod.REBASES[spec.rebase_keeps] == spec.previous
        assert spec.rebase_keeps == chain_groups(spec.previous)
        meta = ckpt.read_meta(rebased_start(scfg, cfg).init_from)
        assert meta.stage == spec.previous and meta.extra["kept"] == list(spec.rebase_keeps)


def chain_groups(stage: str) -> tuple[str, ...]:
    """The groups a stage and every stage before it train (the stages before the router started from the
    previous one's checkpoint)."""
    s, out = STAGE_SPECS[stage], []
    while s is not None:
        out.insert(0, s.group)
        s = STAGE_SPECS.get(s.previous)
    return tuple(out)


def preference_follows_the_chain(pref: tuple[str, ...]) -> bool:
    """Every stage of `pref` is a spec's (or "export"), each ranked before the stage it starts from."""
    return set(pref) <= set(STAGES) | {"export"} and all(
        pref.index(s) < pref.index(STAGE_SPECS[s].previous) for s in pref
        if s in STAGE_SPECS and STAGE_SPECS[s].previous in pref)


def legacy_follows_the_chain(table: dict[str, tuple[str, ...]]) -> bool:
    """Every legacy stage but "export" is a spec's, and its groups are its chain's."""
    legacy = {s: g for s, g in table.items() if s != "export"}
    return set(legacy) <= set(STAGES) and all(g == chain_groups(s) for s, g in legacy.items())


def test_the_checkpoint_layer_stage_tables_follow_the_specs():
    """`STAGE_PREFERENCE` ranks each stage before the stage it starts from; `_LEGACY_TRAINED` holds each legacy
    stage's chain of groups; negative controls: a reversed ranking and a legacy row without a group fail."""
    assert preference_follows_the_chain(ckpt.STAGE_PREFERENCE)
    assert not preference_follows_the_chain(tuple(reversed(ckpt.STAGE_PREFERENCE)))
    assert legacy_follows_the_chain(ckpt._LEGACY_TRAINED)
    assert not legacy_follows_the_chain({**ckpt._LEGACY_TRAINED, "controller": ("backbone", "controller")})


# ------------------------------------------------------------------------------------ no stage-name comparisons
SPEC_MODULE = PACKAGE / "training" / "stages.py"


def _stageish(node: ast.AST) -> bool:
    """`x.stage`, `stage`, `checkpoint_stage`, `stage_name`: an expression that holds a stage's name."""
    return (isinstance(node, ast.Attribute) and node.attr == "stage") or (
        isinstance(node, ast.Name) and (node.id in ("stage", "stage_name") or node.id.endswith("_stage")))


def _literal_names(node: ast.AST) -> bool:
    """A string literal, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def stage_comparisons(source: str) -> list[str]:
    """Comparisons that test a stage by name: a stage-holding expression `==` / `!=` anything (`scfg.stage ==
    "workspace"`, `meta.stage != scfg.stage`), or `in` / `not in` a literal collection (`stage in ("controller",
    "router")`). Membership in a named table (`meta.stage in STAGE_PREFERENCE`) reads data and passes."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, operands, operands[1:]):
            if not (_stageish(a) or _stageish(b)):
                continue
            if isinstance(op, (ast.Eq, ast.NotEq)) or (
                    isinstance(op, (ast.In, ast.NotIn)) and _literal_names(b)):
                out.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
    return out


def test_no_module_compares_a_stage_name_outside_the_spec_table():
    """Outside prisme/training/stages.py no module of the package tests a stage by its name (messages, CLI choices,
    metadata values and config files may still name stages)."""
    found = {str(p.relative_to(PACKAGE)): hits for p in sorted(PACKAGE.rglob("*.py")) if p != SPEC_MODULE
             and (hits := stage_comparisons(p.read_text()))}
    assert found == {}


def test_negative_control_the_stage_name_scan_sees_each_form():
    """Each form the task names is found; table membership, spec fields, docstrings and messages are not."""
    bad = ['if scfg.stage == "workspace": pass', 'ok = meta.stage != scfg.stage', 'x = "router" == s.stage',
           'if stage in ("controller", "router"): pass', 'if stage == "controller": pass',
           'y = self.stage not in ["backbone"]']
    for line in bad:
        assert len(stage_comparisons(line)) == 1, line
    good = ['"""scfg.stage == "workspace" in a docstring"""', 'm = f"stage {scfg.stage!r} needs a workspace"',
            'ok = meta.stage in STAGE_PREFERENCE', 'ok = scfg.spec.owns(meta.stage)', 'n = name == "backbone"',
            'ok = spec.calibrates_values and meta.stage in spec.accepts_init']
    assert [g for g in good if stage_comparisons(g)] == []
    assert stage_comparisons(SPEC_MODULE.read_text())  # the spec table itself compares names (`owns`): allowed there
