"""The analytic cost model (prisme/costs/) against seed 000 and against the modules that exist.

* seed 000: every integer and proxy value for prisme_103m at T = 512, through `cost_table` and the CLI's JSON;
* parameters: the analytic counts per group equal `numel` of the instantiated modules (big presets on `meta`);
* FLOPs: the matmul ops `OpsCounter` (FlopCounterMode + a CPU-SDPA formula) counts on a real float64 decode step of
  small llama configs equal each analytic term, per component and for whole traces, in both columns (seed accounting
  on `optimised=False` models, optimised accounting on `optimised=True` models); norm gains are the named allowance;
* the reference and optimised paths compute the same logits;
* `trace_cost` follows SPEC §6's rules;
and each check has a negative control that breaks it on purpose.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from prisme import cli, costs
from prisme.config import PrismeConfig
from prisme.costs.analytic import COMPONENTS
from prisme.costs.counting import OpsCounter
from prisme.model.outputs import EncodedContext, Rollout
from prisme.model.policy import Controller, StepPolicy, check_policy
from prisme.model.prisme import PrismeModel
from prisme.model.rollout import rollout_forced, rollout_policy
from prisme.options import SLOT_KV_CACHE, ExecutionOptions

SEED000 = json.loads((Path(__file__).parent / "data" / "seed000_costs.json").read_text())
SEED_LAYOUT = {k: v for k, v in SEED000.items() if k != "brief_reference_459m_T4096"}  # a note, not the table
T_CTX = 11  # context of the decoded token in the FLOP ties (!= M, and > 1 so there is a cached prefix)
VARIANTS = {  # small llama configs for the FLOP ties
    "tiny": {},  # M=4, w=32, 2 editor blocks, GQA 4/2
    "tiny_m2_b3": dict(n_slots=2, n_edit_blocks=3, n_kv_head=1, r_max=3),  # M=2: a pair and DENSE both edit 2 slots
    # every source option at once: two summed bank sources with a token shift, z from an intermediate layer, and a
    # controller with its own input projection and the bank-match features
    "tiny_sources": dict(bank_source="residual+embedding", query_source="layer1", bank_shift=True,
                         controller_source="residual", controller_bank=True, controller_entropy=True),
    # the backbone options: each key also reads the previous position (its own term, backbone_key_shift) and a
    # sliding window of 8 < T_CTX keys (backbone_attention at min(t, W)); the workspace still reads the whole bank
    "tiny_backbone_options": dict(key_shift=True, attn_window=8),
    # keys of the position before (the one-step induction read): the same projections, one position later
    "tiny_preceding": dict(bank_source="residual+embedding", bank_key="preceding"),
}
WORKSPACE_TERMS = ("bank_projection", "editor_source_attn", "editor_slot_attn", "editor_ffn", "editor_gate",
                   "controller", "readout")



# ---------------------------------------------------------------------- helpers
def run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["costs", *argv])
    return rc, buf.getvalue()


OPT_MODES = [False, True, SLOT_KV_CACHE]  # the seed's accounting, cfg.optimised (the default), + the slot K/V cache
OPT_IDS = ["seed", "optimised", "slot_kv_cache"]


def make_model(variant: str, optimised: bool | str, seed: int = 0) -> PrismeModel:
    """A float64 model whose weights depend only on (variant, seed), never on `optimised` (the cost model's column:
    False, True, or SLOT_KV_CACHE: optimised with the slot K/V cache, `ExecutionOptions(slot_kv_cache=True)`); U is
    non-zero."""
    return tiny_model(seed, controller=False, **VARIANTS[variant], optimised=bool(optimised),
                      execution=ExecutionOptions(slot_kv_cache=optimised == SLOT_KV_CACHE))


def model_pair(variant: str, seed: int = 0, optimised: bool | str = SLOT_KV_CACHE) -> tuple[PrismeModel, PrismeModel]:
    """(reference, optimised) models holding the same weights (by default the optimised one keeps the slot K/V
    cache: the path with the most to get wrong)."""
    ref, opt = make_model(variant, False, seed), make_model(variant, optimised, seed + 1)
    opt.load_state_dict(ref.state_dict())
    return ref, opt


def decode_token(model: PrismeModel, workspace=None, T: int = T_CTX) -> tuple[OpsCounter, Rollout | None]:
    """Count the ops of generating position T-1 of a random sequence: one backbone step with the KV cache, then
    (with `workspace(ctx) -> Rollout`) the new bank entry and z/S0, the workspace, and the readout; then the head.

    The prefix's backbone pass and bank entries are computed before counting (the decode state already holds them).
    """
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
    cache = model.backbone.new_cache(1, dtype=torch.float64)
    with torch.no_grad():
        st_prev = model.streams(tokens[:, :-1], cache)  # H [1, T-1, d] and the source streams
        if cfg.use_workspace:
            hs_prev = model.bank.inputs(st_prev)
            K_prev, V_prev = model.bank.from_inputs(hs_prev)
            prev = [h[:, -1] for h in hs_prev]  # what a DecodeState keeps for the shift
        roll = None
        with OpsCounter(model) as oc:
            st = model.streams(tokens[:, -1:], cache)  # [1, 1, d]
            H = st.H
            if workspace is None:
                model.backbone.head(H)
            else:
                K, V = model.bank.from_inputs(model.bank.inputs(st), prev)  # [1, 1, w]
                z, S0 = model.query_state(st)
                ctx = EncodedContext(H=H, K=torch.cat([K_prev, K], 1), V=torch.cat([V_prev, V], 1), z=z,
                                     bank_mask=torch.ones(1, 1, T, dtype=torch.bool), S0=S0,
                                     ctrl_in=model.controller_stream(st))
                roll = workspace(ctx)
                model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
    return oc, roll


def one_position_ctx(model: PrismeModel, T: int = T_CTX, seed: int = 3) -> EncodedContext:
    """The workspace inputs of one query position at T-1 with a bank of T entries (computed uncounted)."""
    tokens = torch.randint(0, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        st = model.streams(tokens)
        pos = torch.tensor([[T - 1]])
        return model.context_from_H(st, st.index(torch.zeros(1, 1, dtype=torch.long), pos), query_pos=pos)


def measured_vs_analytic(measured: dict[str, int], analytic: dict[str, int], cfg: PrismeConfig) -> dict:
    """{component: (measured, analytic)} where they differ; `backbone_linear` gets the norm-gain allowance."""
    out = {}
    for c in costs.components(cfg):
        m = measured.get(c, 0) + (costs.backbone_linear_allowance(cfg) if c == "backbone_linear" and
                                  measured.get(c, 0) else 0)
        if m != analytic.get(c, 0):
            out[c] = (m, analytic.get(c, 0))
    if measured.get("untagged", 0):
        out["untagged"] = (measured["untagged"], 0)
    return out


def scripted_select(script: list[int]):
    """A `controller.select` replacement returning script[r] at step r (the controller's forward still runs)."""
    calls = {"r": 0}

    def select(preds, cost, lambda_cost=None, kappa_risk=None):
        r = calls["r"]
        calls["r"] += 1
        return torch.full(preds.value.shape[:-1], script[r], dtype=torch.long)

    return select


# ---------------------------------------------------------------------- seed 000
def test_seed000_table_is_reproduced_exactly_by_cost_table():
    """cost_table(prisme_103m, 512) equals seed 000 in every cell, every proxy value and the assumptions text."""
    doc = costs.cost_table(PrismeConfig.from_name("prisme_103m"), 512)
    assert doc == SEED_LAYOUT
    assert list(doc["rows"]) == list(SEED000["rows"]) and all(
        list(doc["rows"][r]) == list(SEED000["rows"][r]) for r in doc["rows"])  # same order, too


def test_seed000_check_is_not_vacuous_at_another_context():
    """Negative control: at T = 511 exactly the context-dependent cells differ from the seed (the check sees T)."""
    rows = costs.cost_table(PrismeConfig.from_name("prisme_103m"), 511)["rows"]
    changed = {(r, c) for r in rows for c in rows[r] if rows[r][c] != SEED000["rows"][r][c]}
    expected = {(r, c) for r in rows for c in ("backbone_attention", "backbone", "total")}
    expected |= {(r, c) for r in rows if r != "backbone_only" for c in ("editor_source_attn", "workspace")}
    assert changed == expected


def test_seed000_is_reproduced_by_the_cli_json():
    """`prisme costs --preset prisme_103m --context 512 --json` prints exactly one JSON document equal to seed 000."""
    rc, out = run_cli("--preset", "prisme_103m", "--context", "512", "--json")
    assert rc == 0
    assert json.loads(out) == SEED_LAYOUT


def test_cli_json_optimised_adds_the_optimised_column_next_to_the_seed_rows():
    """--optimised adds `optimised_rows` (and its proxy, assumptions) and leaves every seed key unchanged."""
    rc, out = run_cli("--preset", "prisme_103m", "--json", "--optimised")
    doc = json.loads(out)
    assert rc == 0 and {k: doc[k] for k in SEED_LAYOUT} == SEED_LAYOUT
    cfg = PrismeConfig.from_name("prisme_103m")
    assert doc["optimised_rows"] == costs.seed_rows(cfg, 512, optimised=True)
    assert doc["optimised_action_cost_proxy"] == costs.action_cost_proxy(cfg, 512, optimised=True)
    assert set(doc) == set(SEED_LAYOUT) | {"optimised_rows", "optimised_action_cost_proxy", "optimised_assumptions"}


def test_cli_table_shows_seed_and_optimised_totals_and_savings():
    """The human table prints each row's seed and optimised totals (millions) and the saving per row."""
    rc, out = run_cli("--preset", "prisme_103m", "--optimised", "--slot-kv-cache")
    total = next(line for line in out.splitlines() if line.startswith("total "))
    assert rc == 0 and total.split()[1:] == ["217.880", "217.880", "297.860", "266.533", "315.821", "287.640",
                                             "398.817", "340.228", "901.724", "889.272"]
    saving = next(line for line in out.splitlines() if line.startswith("saving"))
    assert "31.326 (10.5%)" in saving and "58.589 (14.7%)" in saving
    rc, out = run_cli("--preset", "prisme_103m", "--optimised")  # the default editor: no slot K/V cache
    total = next(line for line in out.splitlines() if line.startswith("total "))
    assert rc == 0 and total.split()[1:] == ["217.880", "217.880", "297.860", "288.553", "315.821", "306.514",
                                             "398.817", "386.365", "901.724", "889.272"]
    rc, out = run_cli("--preset", "prisme_103m")  # seed column alone: the seed's integers
    assert rc == 0 and "297,859,584" in out and "901,723,648" in out


def test_cli_slot_kv_cache_needs_the_optimised_column(capsys):
    """--slot-kv-cache prices the optimised column's editor: alone it is a one-line error (exit 2)."""
    rc = cli.main(["costs", "--preset", "tiny", "--slot-kv-cache"])
    assert rc == 2 and "--optimised" in capsys.readouterr().err


def test_cli_rejects_a_context_past_t_max_with_a_clear_error(capsys):
    """A context longer than the preset's T_max is a one-line error (exit 2), not a table."""
    rc = cli.main(["costs", "--preset", "tiny", "--context", "65"])
    assert rc == 2 and "T_max=64" in capsys.readouterr().err


def test_prisme_459m_backbone_only_total_is_1296e9():
    """The same formulas give backbone_only = 1.296e9 ops for prisme_459m at T = 4096 (4 significant digits)."""
    total = costs.seed_rows(PrismeConfig.from_name("prisme_459m"), 4096)["backbone_only"]["total"]
    assert f"{total:.3e}" == "1.296e+09"
    assert total == 1_296_141_312


def test_optimised_rows_of_prisme_103m_are_the_documented_values():
    """The optimised column with the slot K/V cache for prisme_103m at T = 512 (docs/costs.md) and its saving on the
    seed column."""
    cfg = PrismeConfig.from_name("prisme_103m")
    seed, opt = costs.seed_rows(cfg, 512), costs.seed_rows(cfg, 512, optimised=SLOT_KV_CACHE)
    assert {r: opt[r]["total"] for r in opt} == {
        "backbone_only": 217_880_064, "4_actions_k1": 266_533_376, "4_actions_k2": 287_640_064,
        "8_actions_k2": 340_227_584, "8_actions_dense16": 889_271_808}
    assert {r: seed[r]["total"] - opt[r]["total"] for r in opt} == {
        "backbone_only": 0, "4_actions_k1": 31_326_208, "4_actions_k2": 28_180_480, "8_actions_k2": 58_589_184,
        "8_actions_dense16": 12_451_840}
    for r in opt:  # only the three optimised terms move
        assert {c for c in COMPONENTS if opt[r][c] != seed[r][c]} <= {"editor_slot_attn", "controller", "readout"}
    default = costs.seed_rows(cfg, 512, optimised=True)  # the editor as the seed's
    assert {r: seed[r]["total"] - default[r]["total"] for r in default} == {
        "backbone_only": 0, "4_actions_k1": 9_306_112, "4_actions_k2": 9_306_112, "8_actions_k2": 12_451_840,
        "8_actions_dense16": 12_451_840}
    assert all(default[r]["editor_slot_attn"] == seed[r]["editor_slot_attn"] for r in default)


def test_model_price_vector_is_the_seed_proxy_at_cost_context():
    """`model.action_cost` is the seed column's proxy at cfg.cost_context (float32), whichever path the model runs."""
    for optimised in (False, True):
        cfg = PrismeConfig.from_name("tiny", optimised=optimised)
        model = PrismeModel(cfg)
        assert torch.equal(model.action_cost, torch.tensor(costs.action_cost_proxy(cfg, cfg.cost_context)))


# ---------------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("preset", ["tiny", "demo", "recall", "seed001", "prisme_103m", "prisme_459m"])
def test_analytic_parameter_counts_equal_module_numel(preset):
    """backbone_params / workspace_params equal sum(p.numel()) of each instantiated group (meta device)."""
    cfg = PrismeConfig.from_name(preset)
    with torch.device("meta"):
        model = PrismeModel(cfg)
    groups = model.num_parameters()
    assert groups == {"backbone": costs.backbone_params(cfg), **costs.workspace_params(cfg)}
    assert sum(groups.values()) == sum(p.numel() for p in model.parameters())  # every parameter is in one group
    assert costs.backbone_params(cfg, non_embedding=True) == model.backbone.num_parameters(non_embedding=True)
    spec = {"seed001": 145_280, "prisme_103m": 99_502_848, "prisme_459m": 446_744_064}  # SPEC §2 and §7
    if preset in spec:
        assert groups["backbone"] == spec[preset]


def test_parameter_count_check_detects_an_extra_parameter():
    """Negative control: one extra bias in an editor block makes the workspace count differ from the analytic one."""
    cfg = PrismeConfig.from_name("tiny")
    model = PrismeModel(cfg)
    model.editor.blocks[0].extra_bias = torch.nn.Parameter(torch.zeros(cfg.w))
    assert model.num_parameters()["workspace"] == costs.workspace_params(cfg)["workspace"] + cfg.w


def test_spec_workspace_figure_is_the_full_count_minus_tables_gains_and_biases():
    """SPEC's 3,634,944 for prisme_103m = our full 3,645,490 minus 10,546: step/remaining tables 8,192, editor norm
    gains 1,536, controller MLP biases 768, b_v/b_r 48, gate biases 2, read off the real modules' names."""
    cfg = PrismeConfig.from_name("prisme_103m")
    with torch.device("meta"):
        model = PrismeModel(cfg)
    ws = {n: p.numel() for n, p in model.named_parameters() if not n.startswith("backbone.")}
    full = sum(ws.values())
    parts = {
        "step/remaining tables": sum(v for n, v in ws.items() if n.endswith(("step_emb.weight", "rem_emb.weight"))),
        "editor norm gains": sum(v for n, v in ws.items() if n.startswith("editor.") and ".norm_" in n),
        "controller MLP biases": sum(v for n, v in ws.items() if n.startswith("controller.mlp.") and
                                     n.endswith(".bias")),
        "b_v/b_r": ws["controller.b_v"] + ws["controller.b_r"],
        "gate biases": sum(v for n, v in ws.items() if n.endswith("gate.bias")),
    }
    assert full == 3_645_490 == sum(costs.workspace_params(cfg).values())
    assert parts == {"step/remaining tables": 8192, "editor norm gains": 1536, "controller MLP biases": 768,
                     "b_v/b_r": 48, "gate biases": 2}
    assert full - sum(parts.values()) == 3_634_944
    # what remains is every matmul weight, slot_embed and the bank norm's gain: the SPEC figure's basis
    rest = {n for n in ws if not any(n.endswith(s) for s in ("step_emb.weight", "rem_emb.weight", ".bias", "b_v",
                                                              "b_r")) and ".norm_" not in n}
    assert {n for n in rest if model.get_parameter(n).dim() < 2} == {"bank_norm.weight"}


# ---------------------------------------------------------------------- FLOP ties, one component at a time
def test_plain_flop_counter_sees_no_cpu_attention_so_a_formula_is_registered():
    """FlopCounterMode counts CPU scaled_dot_product_attention as 0; OpsCounter's formula equals torch's own SDPA
    formula (the one it uses for CUDA kernels) on the same shapes."""
    q, k = torch.randn(2, 4, 3, 16, dtype=torch.float64), torch.randn(2, 4, 7, 16, dtype=torch.float64)
    with FlopCounterMode(display=False) as fc:
        F.scaled_dot_product_attention(q, k, k)
    assert fc.get_total_flops() == 0
    flops = costs.counting._sdpa_cpu_flops(q, k, k)
    assert flops == sdpa_flop_count(q.shape, k.shape, k.shape) == 4 * 2 * 4 * 3 * 7 * 16


BACKBONE_OPTIONS = {"plain": {}, "key_shift": dict(key_shift=True), "window": dict(attn_window=8),
                    "both": dict(key_shift=True, attn_window=8)}


@pytest.mark.parametrize("options", list(BACKBONE_OPTIONS))
@pytest.mark.parametrize("preset", ["tiny", "seed001"])
def test_backbone_decode_step_flops_tie_to_backbone_terms(preset, options):
    """One new token at context T through Backbone.forward with the KV cache + head: measured matmul ops equal
    backbone_linear minus the norm allowance, backbone_attention (L 4 min(T, W) d), backbone_key_shift (L 2 d nkv hd,
    with the key shift) and lm_head (2 d V); gpt2 best effort."""
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name(preset, **BACKBONE_OPTIONS[options])).double().eval()
    oc, _ = decode_token(model)
    assert measured_vs_analytic(oc.by_component, costs.backbone_ops(model.cfg, T_CTX), model.cfg) == {}
    allowance = costs.backbone_linear_allowance(model.cfg)
    if model.cfg.family == "llama":
        assert allowance == 2 * (2 * model.cfg.n_layer + 1) * model.cfg.d_model  # 2 ops per norm gain


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bank_projection_of_one_position_ties(variant):
    """The bank entry and z of the new position: K, V and z, 3 x 2 d w ops with the seed's sources (one K and V per
    bank term and one z per query term otherwise), and the shift's W_K' of the previous position as `bank_shift`."""
    model = make_model(variant, optimised=True)
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        st = model.streams(tokens)
        last = st.index(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[4]]))
        prev = [h[:, -2] for h in model.bank.inputs(st)]
        with OpsCounter(model) as oc:
            model.bank.from_inputs(model.bank.inputs(last), prev)
            model.query_state(last)
    expected = costs.bank_ops(cfg)
    assert {c: oc.by_component[c] for c in expected} == expected and oc.total == sum(expected.values())
    if variant == "tiny":
        assert expected == {"bank_projection": 3 * 2 * cfg.d_model * cfg.w}


EDIT_CASES = [  # (label, actions applied before the counted one, the counted action as "k1" / "k2" / "dense")
    ("k1_first", [], "k1"), ("k2_first", [], "k2"), ("dense_first", [], "dense"),
    ("k1_after_k2", ["k2"], "k1"), ("k2_after_k1", ["k1"], "k2"), ("dense_after_k1", ["k1"], "dense"),
    ("k1_after_dense", ["dense"], "k1"),
]


def action_id(cfg: PrismeConfig, kind: str, i: int = 0) -> int:
    return {"k1": i % cfg.n_slots, "k2": cfg.n_slots + i % (cfg.n_slots // 2), "dense": cfg.dense_action}[kind]


@pytest.mark.parametrize("optimised", OPT_MODES, ids=OPT_IDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("label,before,kind", EDIT_CASES, ids=[c[0] for c in EDIT_CASES])
def test_editor_action_flops_tie_per_component(label, before, kind, variant, optimised):
    """apply_action on one position with a bank of T: the four editor terms equal action_editor_ops, with the
    optimised slot-K/V cost following the cache state (first sparse action / later / after DENSE)."""
    model = make_model(variant, optimised)
    cfg = model.cfg
    ctx = one_position_ctx(model)
    S, slot_kv = ctx.S0, model.new_slot_kv(ctx.S0)
    assert (slot_kv is not None) == (optimised == SLOT_KV_CACHE)
    with torch.no_grad():
        for r, b in enumerate(before):
            S, info = model.apply_action(S, ctx, torch.tensor([[action_id(cfg, b, r)]]), r, 0, slot_kv)
            slot_kv = info.slot_kv
        with OpsCounter(model) as oc:
            model.apply_action(S, ctx, torch.tensor([[action_id(cfg, kind, 1)]]), len(before), 1, slot_kv)
    ready = bool(before) and before[-1] != "dense"
    k = {"k1": 1, "k2": 2, "dense": cfg.n_slots}[kind]
    analytic = costs.action_editor_ops(cfg, k, T_CTX, optimised, ready, dense=kind == "dense")
    assert measured_vs_analytic(oc.by_component, analytic, cfg) == {}
    if optimised == SLOT_KV_CACHE and kind != "dense":  # the cache state matters: first actions pay all M slots' K/V
        assert ready or analytic["editor_slot_attn"] > costs.action_editor_ops(cfg, k, T_CTX, optimised, True,
                                                                               dense=False)["editor_slot_attn"]


@pytest.mark.parametrize("optimised", OPT_MODES[:2], ids=OPT_IDS[:2])  # the slot K/V cache is the editor's
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_controller_step_flops_tie(variant, optimised):
    """One controller forward on one position: state MLP F -> 2w -> w plus W_act on A summaries (M slots if
    optimised); the value/risk heads have no matmul."""
    model = make_model(variant, optimised)
    cfg = model.cfg
    ctx = one_position_ctx(model)
    z, S0 = ctx.z[:, 0], ctx.S0[:, 0]  # [1, w], [1, M, w]
    match = torch.zeros(1, cfg.n_position_features, dtype=torch.float64) if cfg.n_position_features else None
    with torch.no_grad(), OpsCounter(model) as oc:
        model.controller(z, S0, S0, torch.zeros(1, cfg.n_slots, dtype=torch.long),
                         torch.zeros(1, cfg.n_actions, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                         torch.full((1,), cfg.r_max, dtype=torch.long), match)
    assert oc.by_component["controller"] == oc.total == costs.controller_step_ops(cfg, optimised)


def test_controller_inputs_of_one_position_tie():
    """The controller's own inputs, read once per position: P_ctrl (d -> w, `controller_input`), the bank match
    (W_bank w x w plus T key scores, `controller_bank`) and the backbone's entropy (the LM head,
    `controller_entropy`)."""
    model = make_model("tiny_sources", optimised=True)
    cfg = model.cfg
    ctx = one_position_ctx(model)
    with torch.no_grad(), OpsCounter(model) as oc:
        model.controller_inputs(ctx)
    assert oc.by_component["controller_input"] == costs.controller_input_ops(cfg) == 2 * cfg.d_model * cfg.w
    assert oc.by_component["controller_bank"] == costs.controller_bank_ops(cfg, T_CTX) == 2 * cfg.w * (cfg.w + T_CTX)
    assert oc.by_component["controller_entropy"] == costs.controller_entropy_ops(cfg) == 2 * cfg.d_model * \
        cfg.vocab_size
    assert oc.by_component["lm_head"] == 0  # the entropy feature's head is its own term
    assert oc.total == (costs.controller_input_ops(cfg) + costs.controller_bank_ops(cfg, T_CTX)
                        + costs.controller_entropy_ops(cfg))


@pytest.mark.parametrize("optimised", OPT_MODES[:2], ids=OPT_IDS[:2])  # the slot K/V cache is the editor's
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_readout_flops_tie(variant, optimised):
    """The readout on one position: W_q z, two attention reads over M slots (keys projected by W_r, or W_r folded
    into the query), and U."""
    model = make_model(variant, optimised)
    ctx = one_position_ctx(model)
    with torch.no_grad(), OpsCounter(model) as oc:
        model.readout(ctx.S0[:, 0] + 1.0, ctx.S0[:, 0], ctx.z[:, 0])
    assert oc.by_component["readout"] == oc.total == costs.readout_ops(model.cfg, optimised)


# ---------------------------------------------------------------------- FLOP ties, whole decoded tokens
FORCED_TRACES = {  # action kinds in order; the trace is padded with STOP up to R
    "k1_k1_k1_k2": ["k1", "k1", "k1", "k2"],
    "dense_then_k1": ["dense", "k1"],
    "k2_then_stop": ["k2", "stop", "k1"],  # STOP is absorbing: the k1 after it never runs
}


@pytest.mark.parametrize("optimised", OPT_MODES, ids=OPT_IDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("trace", list(FORCED_TRACES))
def test_forced_trace_of_a_decoded_token_ties_to_trace_cost(trace, variant, optimised):
    """A whole decoded token (backbone step, bank entry, rollout_forced, readout, head) under a forced multi-action
    trace: measured ops per component equal trace_cost's (no controller), in the model's own column."""
    model = make_model(variant, optimised)
    cfg = model.cfg
    kinds = FORCED_TRACES[trace][:cfg.r_max]
    ids = [cfg.stop_action if k == "stop" else action_id(cfg, k, i) for i, k in enumerate(kinds)]
    actions = torch.tensor([[ids]])  # [1, 1, R]
    oc, roll = decode_token(model, lambda ctx: rollout_forced(model, ctx, StepPolicy(actions=actions)))
    expected = costs.trace_cost(cfg, actions[0], [T_CTX], None, optimised=optimised)
    assert measured_vs_analytic(oc.by_component, expected.by_component, cfg) == {}
    assert oc.total + costs.backbone_linear_allowance(cfg) == expected.total_ops
    assert int(roll.controller_steps.sum()) == 0 and expected.by_component["controller"] == 0


POLICY_SCRIPTS = {  # controller decisions per step (STOP = "stop"), budget
    "stops_at_once": (["stop"], 3),
    "two_actions_then_stop": (["k1", "k2", "stop"], 3),
    "budget_exhausted": (["k2", "k1", "k1"], 3),
}


@pytest.mark.parametrize("optimised", OPT_MODES, ids=OPT_IDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("script", list(POLICY_SCRIPTS))
def test_policy_trace_of_a_decoded_token_ties_to_trace_cost(script, variant, optimised, monkeypatch):
    """A decoded token under the controller (rollout_policy; decisions scripted, the controller still runs):
    measured ops equal trace_cost with the trace's own controller steps = min(n + 1, budget); a position the
    controller stopped at once pays the bank projection and one controller step, no readout."""
    model = make_model(variant, optimised)
    cfg = model.cfg
    decisions, budget = POLICY_SCRIPTS[script]
    ids = [cfg.stop_action if k == "stop" else action_id(cfg, k, i) for i, k in enumerate(decisions)]
    monkeypatch.setattr(model.controller, "select", scripted_select(ids))
    oc, roll = decode_token(model, lambda ctx: rollout_policy(model, ctx, check_policy(model, Controller(budget))))
    n = int(roll.n_edits.sum())
    assert int(roll.controller_steps.sum()) == min(n + 1, budget)
    expected = costs.trace_cost(cfg, roll.actions[0], [T_CTX], roll.controller_steps[0], optimised=optimised)
    assert measured_vs_analytic(oc.by_component, expected.by_component, cfg) == {}
    if n == 0:
        assert oc.by_component["readout"] == 0 and oc.by_component["editor_ffn"] == 0
        assert oc.by_component["controller"] == costs.controller_step_ops(cfg, optimised)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_budget_zero_decode_is_the_backbone_alone(variant):
    """max_budget = 0: the decode step runs the backbone and head only, and trace_cost charges exactly that."""
    model = make_model(variant, optimised=True)
    oc, _ = decode_token(model)
    expected = costs.trace_cost(model.cfg, torch.zeros(1, 0, dtype=torch.long), [T_CTX], [0])
    assert measured_vs_analytic(oc.by_component, expected.by_component, model.cfg) == {}
    assert all(oc.by_component[c] == 0 for c in WORKSPACE_TERMS)


@pytest.mark.parametrize("optimised", OPT_MODES, ids=OPT_IDS)
@pytest.mark.parametrize("row", list(costs.SEED_ROWS))
def test_seed_rows_tie_on_a_tiny_model(row, optimised, monkeypatch):
    """Each seed row (n actions of k, or n DENSE; n capped at r_max = 4) decoded on tiny under the controller
    (decisions scripted) ties to token_ops with the seed rows' conventions, in both columns."""
    model = make_model("tiny", optimised)
    cfg = model.cfg
    n, k = costs.SEED_ROWS[row]
    n, dense = min(n, cfg.r_max), row.endswith("dense16")
    if n == 0:
        oc, _ = decode_token(model)
    else:
        kind = "dense" if dense else f"k{k}"
        monkeypatch.setattr(model.controller, "select", scripted_select([action_id(cfg, kind, i) for i in range(n)]))
        oc, _ = decode_token(model, lambda ctx: rollout_policy(model, ctx, check_policy(model, Controller(n))))
    expected = costs.token_ops(cfg, T_CTX, [cfg.n_slots if dense else k] * n, controller_steps=0 if n == 0 else None,
                               optimised=optimised, dense=[dense] * n)
    if n == costs.SEED_ROWS[row][0]:
        assert expected == costs.seed_rows(cfg, T_CTX, optimised)[row]
    assert measured_vs_analytic(oc.by_component, expected, cfg) == {}


# ---------------------------------------------------------------------- negative controls for the FLOP tie
def test_flop_tie_detects_a_perturbed_formula():
    """Negative control: slot attention priced over M + 1 slots instead of M makes exactly that term mismatch."""
    model = make_model("tiny", optimised=False)
    cfg = model.cfg
    ctx = one_position_ctx(model)
    with torch.no_grad(), OpsCounter(model) as oc:
        model.apply_action(ctx.S0, ctx, torch.tensor([[0]]), 0, 1)
    wrong = costs.action_editor_ops(cfg.replace(n_slots=cfg.n_slots + 2), 1, T_CTX)  # M -> M + 2
    wrong = {**costs.action_editor_ops(cfg, 1, T_CTX), "editor_slot_attn": wrong["editor_slot_attn"]}
    assert set(measured_vs_analytic(oc.by_component, wrong, cfg)) == {"editor_slot_attn"}


def test_flop_tie_detects_an_editor_that_projects_an_extra_slot():
    """Negative control: an editor block that projects one extra slot's K/V (and drops it: same logits) fails the
    tie on editor_slot_attn, while its logits still agree: only the cost check can see it."""
    model = make_model("tiny", optimised=False)
    cfg = model.cfg
    actions = torch.tensor([[[0, cfg.n_slots]]])
    clean, _ = decode_token(model, lambda ctx: rollout_forced(model, ctx, StepPolicy(actions=actions)))
    blk = model.editor.blocks[1]

    def wasteful(X: torch.Tensor) -> torch.Tensor:
        return blk.slot_kv(blk.norm_slot(torch.cat([X, X[..., :1, :]], dim=-2)))[..., :-1, :]

    blk.slot_keys_values = wasteful
    ctx = one_position_ctx(model)
    with torch.no_grad():
        ref = model.logits_from_state(rollout_forced(model, ctx, StepPolicy(actions=actions)).S, ctx)[0]
    dirty, _ = decode_token(model, lambda ctx: rollout_forced(model, ctx, StepPolicy(actions=actions)))
    del blk.slot_keys_values
    with torch.no_grad():
        good = model.logits_from_state(rollout_forced(model, ctx, StepPolicy(actions=actions)).S, ctx)[0]
    assert float((ref - good).abs().max()) < 1e-12
    expected = costs.trace_cost(cfg, actions[0], [T_CTX]).by_component
    assert measured_vs_analytic(clean.by_component, expected, cfg) == {}
    assert set(measured_vs_analytic(dirty.by_component, expected, cfg)) == {"editor_slot_attn"}


def test_flop_tie_detects_an_optimised_model_running_the_seed_readout():
    """Negative control: an optimised model whose readout does not fold W_r is caught by the optimised column."""
    model = make_model("tiny", optimised=True)
    ctx = one_position_ctx(model)
    model.readout.optimised = False
    with torch.no_grad(), OpsCounter(model) as oc:
        model.readout(ctx.S0[:, 0], ctx.S0[:, 0], ctx.z[:, 0])
    assert oc.total == costs.readout_ops(model.cfg, optimised=False) != costs.readout_ops(model.cfg, optimised=True)


def test_ops_counter_restores_the_model():
    """OpsCounter removes its hooks and its head wrapper on exit: the model runs and counts as before."""
    model = make_model("tiny", optimised=True)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with OpsCounter(model):
        pass
    assert "head" not in vars(model.backbone)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks


# ---------------------------------------------------------------------- reference path == optimised path
@pytest.mark.parametrize("optimised", OPT_MODES[1:], ids=OPT_IDS[1:])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_and_optimised_paths_agree_for_forced_actions(variant, optimised):
    """Same weights, forced random actions (singles, pairs, DENSE, STOP): logits agree to 1e-12 in float64."""
    ref, opt = model_pair(variant, optimised=optimised)
    cfg = ref.cfg
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    actions = torch.randint(0, cfg.dense_action + 1, (2, 16, cfg.r_max), generator=g)
    with torch.no_grad():
        a, b = ref(tokens, actions), opt(tokens, actions)
        base = ref.backbone.head(ref.backbone(tokens))
    assert float((a.logits - b.logits).abs().max()) < 1e-12
    assert float((a.logits - base).abs().max()) > 1e-3  # the edits are visible: the comparison is not vacuous


@pytest.mark.parametrize("optimised", OPT_MODES[1:], ids=OPT_IDS[1:])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_and_optimised_paths_agree_under_the_controller(variant, optimised):
    """Same weights, forward_policy: identical action traces and logits to 1e-12 in float64."""
    ref, opt = model_pair(variant, optimised=optimised)
    cfg = ref.cfg
    with torch.no_grad():  # a controller whose decisions vary from position to position
        for m in (ref, opt):
            torch.manual_seed(7)
            for p in m.controller.parameters():
                torch.nn.init.normal_(p, std=0.3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    a = ref.forward_policy(tokens, cfg.r_max, lambda_cost=0.0)
    b = opt.forward_policy(tokens, cfg.r_max, lambda_cost=0.0)
    assert torch.equal(a.actions, b.actions) and torch.equal(a.controller_steps, b.controller_steps)
    assert 0 < int(a.n_edits.sum()) < a.n_edits.numel() * cfg.r_max  # some positions edit, not all to the cap
    assert float((a.logits - b.logits).abs().max()) < 1e-12


def test_path_equivalence_check_detects_a_stale_slot_kv_cache(monkeypatch):
    """Negative control: an optimised model that trusts an empty slot K/V cache (marked ready) diverges from the
    reference path far beyond 1e-12."""
    ref, opt = model_pair("tiny")
    cfg = ref.cfg
    fresh = opt.new_slot_kv

    def stale(S0, run=None):
        cache = fresh(S0, run)
        cache.ready.fill_(True)
        return cache

    monkeypatch.setattr(opt, "new_slot_kv", stale)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(8))
    actions = torch.zeros(1, 12, 2, dtype=torch.long)
    with torch.no_grad():
        diff = float((ref(tokens, actions).logits - opt(tokens, actions).logits).abs().max())
    assert diff > 1e-6


# ---------------------------------------------------------------------- trace_cost rules (SPEC §6)
def test_trace_cost_charges_each_position_its_own_context():
    """Attention terms use each position's own context t + 1: summed over positions, not T_max per position."""
    cfg = PrismeConfig.from_name("tiny")
    contexts = [1, 5, 9]
    tc = costs.trace_cost(cfg, [[0], [1], [cfg.n_slots]], contexts)
    assert tc.by_component["backbone_attention"] == cfg.n_layer * 4 * cfg.d_model * sum(contexts)
    per = [costs.token_ops(cfg, t, [k], controller_steps=0) for t, k in zip(contexts, [1, 1, 2])]
    assert tc.total_ops == sum(r["total"] for r in per)


def test_trace_cost_position_stopped_at_once_pays_bank_and_one_controller_step():
    """A controller position that stopped at once pays the bank projection and one controller step, no readout."""
    cfg = PrismeConfig.from_name("tiny")
    tc = costs.trace_cost(cfg, [[cfg.stop_action] * 3], [7], [1])
    extra = {c: v for c, v in tc.by_component.items() if c not in costs.BACKBONE and v}
    assert extra == {"bank_projection": costs.bank_projection_ops(cfg), "controller": costs.controller_step_ops(cfg)}


def test_trace_cost_controller_pays_min_n_plus_one_budget_steps_and_forced_pays_none():
    """Under the controller n actions pay their controller steps (min(n + 1, budget)); forced policies pay none;
    both pay the bank projection, the editor and the readout."""
    cfg = PrismeConfig.from_name("tiny")
    acts = [[0, cfg.n_slots, cfg.stop_action, cfg.stop_action]]
    ctrl = costs.trace_cost(cfg, acts, [9], [3])
    forced = costs.trace_cost(cfg, acts, [9], None)
    assert ctrl.by_component["controller"] == 3 * costs.controller_step_ops(cfg)
    assert forced.by_component["controller"] == 0
    assert {c: v for c, v in ctrl.by_component.items() if c != "controller"} == \
        {c: v for c, v in forced.by_component.items() if c != "controller"}
    assert forced.by_component["readout"] == costs.readout_ops(cfg) and forced.by_component["bank_projection"] > 0


def test_trace_cost_budget_zero_is_the_backbone_alone():
    """max_budget = 0 (actions [N, 0], or None) costs exactly the backbone, as forward_policy(max_budget=0) traces."""
    model = make_model("tiny", optimised=True)
    tokens = torch.randint(0, 64, (2, 5))
    out = model.forward_policy(tokens, 0)
    contexts = torch.arange(1, 6).expand(2, 5)
    tc = costs.trace_cost(model.cfg, out.actions, contexts, out.controller_steps)
    assert tc.total_ops == tc.backbone_ops == costs.trace_cost(model.cfg, None, contexts).total_ops
    assert tc.relative == 1.0


def test_trace_cost_stop_is_absorbing():
    """Actions after the first STOP are not charged (the model never runs them)."""
    cfg = PrismeConfig.from_name("tiny")
    stop = cfg.stop_action
    assert costs.trace_cost(cfg, [[0, stop, 1, 2]], [4]).total_ops == costs.trace_cost(cfg, [[0]], [4]).total_ops


@pytest.mark.parametrize("optimised", OPT_MODES, ids=OPT_IDS)
def test_trace_cost_is_monotone_in_budget_and_terms_sum_to_totals(optimised):
    """Fixed n x k and n DENSE traces cost strictly more at every extra action (both columns), controller rows too;
    components sum to the totals and backbone + workspace = total."""
    cfg = PrismeConfig.from_name("prisme_103m")
    for ids in ([0] * cfg.r_max, [cfg.n_slots] * cfg.r_max, [cfg.dense_action] * cfg.r_max):
        last_forced = last_ctrl = -1.0
        for n in range(cfg.r_max + 1):
            acts = [ids[:n] + [cfg.stop_action] * (cfg.r_max - n)]
            forced = costs.trace_cost(cfg, acts, [300], None, optimised)
            ctrl = costs.trace_cost(cfg, acts, [300], [min(n + 1, cfg.r_max)], optimised)
            assert forced.total_ops > last_forced and ctrl.total_ops > last_ctrl
            assert sum(forced.by_component.values()) == forced.total_ops
            last_forced, last_ctrl = forced.total_ops, ctrl.total_ops
    for row in costs.seed_rows(cfg, 512, optimised).values():
        assert sum(row[c] for c in COMPONENTS) == row["total"] == row["backbone"] + row["workspace"]


def test_trace_cost_rejects_bad_input_with_value_errors():
    """Unknown action ids, mismatched shapes, negative controller steps and contexts past T_max are ValueErrors."""
    cfg = PrismeConfig.from_name("tiny")
    with pytest.raises(ValueError, match="action id"):
        costs.trace_cost(cfg, [[cfg.dense_action + 1]], [3])
    with pytest.raises(ValueError, match="positions"):
        costs.trace_cost(cfg, [[0], [1]], [3])
    with pytest.raises(ValueError, match="controller_steps"):
        costs.trace_cost(cfg, [[0]], [3], [-1])
    with pytest.raises(ValueError, match="T_max"):
        costs.trace_cost(cfg, [[0]], [cfg.max_seq_len + 1])


# ---------------------------------------------------------------------- the source-bank options
def test_source_options_parameter_counts_equal_module_numel():
    """Two summed bank sources with a shift, z from an intermediate layer, a controller projection and bank match:
    workspace_params equals the instantiated groups (norm per stream, K/V per bank term, W_K' per term, ...)."""
    cfg = PrismeConfig.from_name("tiny", **VARIANTS["tiny_sources"])
    with torch.device("meta"):
        model = PrismeModel(cfg)
    assert model.num_parameters() == {"backbone": costs.backbone_params(cfg), **costs.workspace_params(cfg)}


def test_new_terms_appear_only_where_configured():
    """The seed's inputs keep exactly seed 000's ten terms (so `prisme costs --json` is unchanged); a shifted bank adds
    `bank_shift` after `bank_projection`, a controller source and bank match add `controller_input` and
    `controller_bank` after `controller`."""
    plain = costs.seed_rows(PrismeConfig.from_name("tiny"), 16)["4_actions_k1"]
    assert [c for c in plain if c not in ("backbone", "workspace", "total")] == list(COMPONENTS)
    cfg = PrismeConfig.from_name("tiny", **VARIANTS["tiny_sources"])
    row = costs.token_ops(cfg, 16, [1, 2])
    assert list(row)[:13] == [*COMPONENTS[:4], "bank_shift", *COMPONENTS[4:9], "controller_input", "controller_bank",
                              "controller_entropy"]
    assert row["bank_shift"] == 2 * 2 * cfg.d_model * cfg.w  # one W_K' per bank term
    assert costs.token_ops(cfg, 16, [1], controller_steps=0)["controller_input"] == 0  # forced runs pay none


def test_negative_control_a_cost_model_without_the_shift_term_fails_the_tie(monkeypatch):
    """If the analytic model forgot the shift's projection, the whole-token FLOP tie reports `bank_shift`."""
    model = make_model("tiny_sources", optimised=True)
    cfg = model.cfg
    actions = torch.tensor([[[0, cfg.n_slots]]])
    oc, _ = decode_token(model, lambda ctx: rollout_forced(model, ctx, StepPolicy(actions=actions)))
    expected = costs.trace_cost(cfg, actions[0], [T_CTX], None, optimised=True)
    assert measured_vs_analytic(oc.by_component, expected.by_component, cfg) == {}
    monkeypatch.setattr(costs.bank, "bank_shift_ops", lambda cfg, entries=1, decode=None: 0)
    broken = costs.trace_cost(cfg, actions[0], [T_CTX], None, optimised=True)
    assert "bank_shift" in measured_vs_analytic(oc.by_component, broken.by_component, cfg)


def test_distinct_rows_equals_unique_over_rows():
    """`traces.distinct_rows` (the packed 1-D unique that prices each distinct trace once) gives `torch.unique(dim=0)`'s
    rows and counts: negative entries (DENSE's -1 kind), one column, a single row, and ranges too wide to pack (the
    fallback). Negative control: packing without each column's minimum (a plain radix of max + 1) merges rows."""
    from prisme.costs.traces import distinct_rows

    g = torch.Generator().manual_seed(0)
    cases = [torch.cat([torch.randint(1, 129, (4000, 1), generator=g), torch.randint(0, 3, (4000, 1), generator=g),
                        torch.randint(-1, 3, (4000, 3), generator=g)], 1),
             torch.randint(-5, 5, (300, 1), generator=g), torch.tensor([[7, -1, 2]]),
             torch.tensor([[2**40, 0, 2**40], [0, 2**40, 1], [2**40, 0, 2**40]])]
    for rows in cases:
        want = torch.unique(rows, dim=0, return_counts=True)
        got = distinct_rows(rows)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rows = cases[0]
    radix = (rows.amax(0) + 1).tolist()  # the bug: -1 and 2 of one column share a digit with the next column's
    packed = torch.zeros(rows.shape[0], dtype=torch.long)
    for c, r in enumerate(radix):
        packed = packed * r + rows[:, c]
    assert torch.unique(packed).numel() != torch.unique(rows, dim=0).shape[0]


def test_costs_prints_the_deployed_row_that_reproduces_a_study_ratio(capsys):
    """`prisme costs --fire-rate R` prices the router at budget 1 over a sequence of T (each position at its own
    context, the studies' pricing): the T = 1,024 recall winner at its 0.61 % of positions against the dense model
    it was compared with gives the recorded ratio 0.338 within the trace's placement (0.35); at rate 0 it still pays
    the router and the bank (above the backbone alone), and more edits cost more (negative controls)."""
    from prisme import cli
    from prisme.costs.table import deployed_row, sequence_row

    win = PrismeConfig.from_name("recall_long", d_model=12, n_head=2, n_kv_head=2, w=32, attn_window=64,
                                 key_shift=True, router=True, router_token=True)
    dense = PrismeConfig.from_name("recall_long", d_model=16, n_head=2, n_kv_head=2, key_shift=True,
                                   use_workspace=False)
    ratio = deployed_row(win, 1024, 0.0061)["ops_per_token"] / sequence_row(dense, 1024)["ops_per_token"]
    assert 0.33 < ratio < 0.36
    off, some = deployed_row(win, 1024, 0.0), deployed_row(win, 1024, 0.05)
    assert 1.0 < off["x_backbone_only"] < some["x_backbone_only"]
    assert deployed_row(win, 1024, 0.0061, bank_store="ids")["ops_per_token"] < deployed_row(win, 1024, 0.0061)[
        "ops_per_token"]  # a bank kept as ids reads cheaper
    argv = ["costs", "--preset", "recall_long", "--set", "d_model=12", "--set", "n_head=2", "--set", "n_kv_head=2",
            "--set", "w=32", "--set", "attn_window=64", "--set", "key_shift=true", "--set", "router=true",
            "--context", "1024", "--fire-rate", "0.0061"]
    assert cli.main(argv) == 0
    assert "deployed over a sequence of 1,024 (the router at budget 1, 0.59% of positions edit one slot)" in \
        capsys.readouterr().out
    assert cli.main(["costs", "--preset", "tiny", "--fire-rate", "0.01"]) == 2
    assert "prices a router model's deployed step; 'tiny' has no router (--set router=true)" in capsys.readouterr().err
    assert cli.main(["costs", "--preset", "tiny", "--set", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
