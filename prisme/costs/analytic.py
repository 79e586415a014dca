"""Analytic cost model: operations per generated token, one named term per component (seed 000, SPEC §6).

Notation: d backbone width, L layers, V vocab, T context (keys the new token attends to), w workspace width,
M slots, A = M + M/2 actions, B_e editor blocks, h_e editor hidden, F controller features, n actions of k slots.

Conventions (the seed's):
  * one multiply-add = 2 ops; softmax, norms and activations are ignored (O(dim), not O(dim^2)), except that norm
    gains count in `backbone_linear` (2 ops per gain) because that term is 2 x non-embedding parameters;
  * decode step: the backbone attends over the whole context T (KV cache), or its last W positions with a sliding
    window (`attn_window`: min(T, W) keys); the LM head is included; a key shift (`key_shift`) is its own term,
    `backbone_key_shift`: one d x (n_kv_head head_dim) projection per layer, outside `backbone_linear`;
  * the source bank is incremental: K, V and z of the new position only (3 projections d -> w);
  * the editor reads the whole bank (T keys) for every edited slot in every block (`editor_source_attn`);
  * seed accounting (`optimised=False`, what `cfg.optimised=False` models run): every block refreshes the K/V of
    all M slots of the position for every action; the controller projects all A action summaries; the readout
    projects the M slots of both states with W_r;
  * optimised accounting (`optimised=True`, what `cfg.optimised` models run): the controller projects the M slots
    and averages pairs (M w^2 instead of A w^2); the readout folds W_r into its query (2 w^2 once instead of
    2 M w^2 per state). With the editor's slot K/V cache too (`optimised=SLOT_KV_CACHE`: `ExecutionOptions.column`
    of a model whose execution keeps one), slot K/V are computed once per
    edited position (all M slots, every block: the first sparse action pays it), then only for the slots an action
    changes (its k slots in blocks >= 1, and a refresh of its k slots in every block after it); DENSE actions keep
    the seed's path and leave the position without a slot K/V cache. Without it the editor counts as the seed's.

Sources: seed 000 (cost table for prisme_103m at T = 512); SPEC §6. docs/costs.md derives every term;
tests/test_costs.py checks every integer of the seed, ties each term to the matmul FLOPs that
`torch.utils.flop_counter.FlopCounterMode` counts on the real modules (`OpsCounter`), and parameter counts to `numel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prisme.config import COPY_FEATURES, PrismeConfig
from prisme.costs.bank import bank_ops, id_read_attention_ops, reads_through_tables
from prisme.costs.bank import checked_context as _check_T
from prisme.options import PROJECTED, SLOT_KV_CACHE, DecodeOptions

COMPONENTS = ("backbone_linear", "backbone_attention", "lm_head", "bank_projection", "editor_source_attn",
              "editor_slot_attn", "editor_ffn", "editor_gate", "controller", "readout")
BACKBONE = COMPONENTS[:3]
BACKBONE_TERMS = (*BACKBONE, "backbone_key_shift", "copy_head")  # every term that counts as the backbone's (the
#   copy head is part of its head: dense models and PRISME's backbone alike pay it at every position)
OPTIONAL_COMPONENTS = ("backbone_key_shift", "copy_head", "bank_shift", "router", "controller_input",
                       "controller_bank", "controller_entropy")


def components(cfg: PrismeConfig) -> tuple[str, ...]:
    """The cost model's terms for `cfg`: seed 000's ten, plus `backbone_key_shift` (after `backbone_attention`) with a
    key shift, `bank_shift` (after `bank_projection`) with a shifted bank and `controller_input` (after
    `controller`) with a controller source of its own. A config with the seed's backbone and workspace inputs has
    exactly seed 000's terms."""
    out = list(COMPONENTS)
    if cfg.key_shift:
        out.insert(out.index("backbone_attention") + 1, "backbone_key_shift")
    if cfg.copy_head:
        out.insert(out.index("lm_head") + 1, "copy_head")
    if cfg.bank_shift:
        out.insert(out.index("bank_projection") + 1, "bank_shift")
    if cfg.router:
        out.insert(out.index("controller"), "router")
    if cfg.controller_source is not None:
        out.insert(out.index("controller") + 1, "controller_input")
    at = out.index("controller") + 1 + (cfg.controller_source is not None)
    if cfg.controller_bank:
        out.insert(at, "controller_bank")
        at += 1
    if cfg.controller_entropy:
        out.insert(at, "controller_entropy")
    return tuple(out)


def router_ops(cfg: PrismeConfig, T: int) -> int:
    """The router (`cfg.router`, prisme.model.router) at one position of context T: the linear value head over
    [norm(H), seen] (2 (d + 1) A; 2 d A with router_ngram = 0) plus its n-gram feature, n token comparisons against
    each of the T - 1 earlier positions, counted as one op each (`router_match_ops`), and with `router_token` A adds
    of the current token's row of its value table. 0 without a router."""
    if not cfg.router:
        return 0
    n = cfg.router_ngram
    return 2 * (cfg.d_model + (1 if n > 0 else 0)) * cfg.n_actions + router_lookup_ops(cfg) + router_match_ops(cfg, T)


def router_lookup_ops(cfg: PrismeConfig) -> int:
    """The router's token table (`cfg.router_token`) at one position: one row lookup and A adds (no matmul: a named
    allowance in the tie to counted FLOPs); 0 without it."""
    return cfg.n_actions if cfg.router and cfg.router_token else 0


def router_match_ops(cfg: PrismeConfig, T: int) -> int:
    """The router's n-gram feature at context T: n id comparisons per earlier position (no matmul: a named allowance
    in the tie to counted FLOPs)."""
    return cfg.router_ngram * (T - 1) if cfg.router else 0


def router_share_of_layer(cfg: PrismeConfig, T: int | None = None) -> float:
    """The router's ops per position over one backbone layer's (its linears and attention at context T, default
    `cfg.cost_context`): what "nearly free" is measured against."""
    T = _check_T(cfg, cfg.cost_context if T is None else T)
    layer = 2 * matmul_params_per_layer(cfg) + 4 * attended_keys(cfg, T) * cfg.d_model
    return router_ops(cfg, T) / layer


def controller_entropy_ops(cfg: PrismeConfig) -> int:
    """The backbone's entropy as a controller feature (`cfg.controller_entropy`): the LM head on H, 2 d V, once per
    position the controller runs at (the softmax and the sum are not counted)."""
    return 2 * cfg.d_model * cfg.vocab_size if cfg.controller_entropy else 0


def controller_bank_ops(cfg: PrismeConfig, T: int) -> int:
    """The controller's bank match at context T (`cfg.controller_bank`): q_c = W_bank z_c (w x w) and its scores
    against the T keys, once per position it runs at (0 without it)."""
    return 2 * cfg.w * cfg.w + 2 * T * cfg.w if cfg.controller_bank else 0


def controller_input_ops(cfg: PrismeConfig) -> int:
    """The controller's own projection d -> w of its source stream, once per position it runs at (0 when it reads
    z, as in the seed)."""
    return 2 * cfg.d_model * cfg.w if cfg.controller_source is not None else 0
SEED_ROWS = {  # name: (n actions, k slots per action); k = 0 means no workspace
    "backbone_only": (0, 0),
    "4_actions_k1": (4, 1),
    "4_actions_k2": (4, 2),
    "8_actions_k2": (8, 2),
    "8_actions_dense16": (8, 16),
}
# Seed 000's `assumptions`, verbatim: it describes the seed column (`optimised=False`).
SEED_ASSUMPTIONS = (
    'Analytic operation counts (2 x multiply-adds = "ops") per generated token at context length T.\n\n'
    "This is an ARITHMETIC model of the reference implementation, not a hardware timing model. Conventions:\n"
    "  * one multiply-add = 2 ops; softmax/normalisation/activation costs are ignored "
    "(they are O(dim), not O(dim^2));\n"
    "  * decode-step accounting: the backbone attends over the whole context T (KV cache), the LM head is included;\n"
    "  * source-bank projections are incremental (only the new position is projected);\n"
    "  * the editor re-reads the full bank (T keys) for every active query of every block, and refreshes the slot K/V\n"
    "    of all M slots in every block (reference implementation; an optimised kernel could cache unchanged slots);\n"
    "  * controller: one shared state MLP per step + one w x w projection per candidate action (A = M + M/2);\n"
    "  * readout: two attention reads (final and initial state) + the U projection.\n"
)
ASSUMPTIONS = SEED_ASSUMPTIONS
OPTIMISED_ASSUMPTIONS = (
    "Same conventions as the seed column, for the modules `cfg.optimised=True` runs:\n"
    "  * controller: W_act projects the M slots once per step; pair summaries are means of projected slots;\n"
    "  * readout: W_r is folded into the query (q' = W_r^T W_q z), so slots are never projected;\n"
    "  * editor: as the seed counts it (every slot's K/V in every block), unless the slot K/V cache is on.\n"
)
SLOT_KV_ASSUMPTIONS = (
    "  * slot K/V cache (`slot_kv_cache`): the first sparse action of a position projects all M slots in every block;\n"
    "    each sparse action then projects only its own k slots (blocks >= 1 at their input, and every block after\n"
    "    the action); DENSE actions keep the seed's path and invalidate the cache.\n"
)


# ---------------------------------------------------------------------- parameter counts
def matmul_params_per_layer(cfg: PrismeConfig) -> int:
    """Weights one token multiplies with in one block: wqkv, wo, w13, w2 (biases and norms excluded)."""
    d, f = cfg.d_model, cfg.ffn_hidden
    qkv_out = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    mlp = 3 * d * f if cfg.family == "llama" else 2 * d * f
    return d * qkv_out + cfg.n_head * cfg.head_dim * d + mlp


def key_shift_params(cfg: PrismeConfig) -> int:
    """The key shift's projections W_s (d -> n_kv_head head_dim per layer, no bias); 0 without `key_shift`."""
    return cfg.n_layer * cfg.d_model * cfg.n_kv_head * cfg.head_dim if cfg.key_shift else 0


def attended_keys(cfg: PrismeConfig, T: int) -> int:
    """Keys a new token at context T attends to: T, or min(T, W) with a sliding window `attn_window` = W."""
    return T if cfg.attn_window is None else min(T, cfg.attn_window)


def _backbone_matmul_params(cfg: PrismeConfig) -> int:
    """Weights of the backbone's per-layer linears (qkv, o, MLP), all layers."""
    return cfg.n_layer * matmul_params_per_layer(cfg)


def backbone_params(cfg: PrismeConfig, non_embedding: bool = False) -> int:
    """Backbone parameters from the config alone (tied head counted once).

    non_embedding: exclude the token/position embeddings and an untied head (the seed's `backbone_linear` basis).
    """
    d, L = cfg.d_model, cfg.n_layer
    qkv_out = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    if cfg.family == "llama":  # two RMSNorm gains per layer, one final
        extra = L * 2 * d + d
    else:  # biases of qkv, o and the MLP; two LayerNorms (weight + bias) per layer, one final
        extra = L * (qkv_out + d + cfg.ffn_hidden + d + 4 * d) + 2 * d
    n = _backbone_matmul_params(cfg) + extra + key_shift_params(cfg)
    if non_embedding:
        return n
    n += cfg.vocab_size * d
    if cfg.family == "gpt2":
        n += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        n += cfg.vocab_size * d
    return n


def backbone_linear_allowance(cfg: PrismeConfig) -> int:
    """Ops in `backbone_linear` that are not matmul FLOPs: 2 per norm gain (llama), 2 per norm weight/bias and
    linear bias (gpt2). `FlopCounterMode` counts exactly `backbone_linear - allowance` for the backbone's linears
    (the key shift's W_s is `backbone_key_shift`'s)."""
    return 2 * (backbone_params(cfg, non_embedding=True) - _backbone_matmul_params(cfg) - key_shift_params(cfg))


def workspace_params(cfg: PrismeConfig) -> dict[str, int]:
    """Parameters of the workspace modules by group (`PrismeModel.num_parameters` minus the backbone)."""
    if not cfg.use_workspace:
        return {"workspace": 0, "controller": 0}
    d, w, M, h = cfg.d_model, cfg.w, cfg.n_slots, cfg.editor_hidden
    nb, nq = len(cfg.bank_terms), len(cfg.query_terms)
    streams = len(set(cfg.bank_terms + cfg.query_terms))  # one norm per source stream (bank_norm, src_norm)
    shift = nb * d * w if cfg.bank_shift else 0  # W_K_shift (and one per extra bank term)
    bank = streams * d + (2 * nb + nq) * d * w + shift + M * w  # norms, W_K, W_V, P (per term), slot_embed
    block = (3 * w  # three RMSNorm gains
             + 2 * w * w  # source-attention q, o
             + 4 * w * w  # slot-attention q, k, v, o
             + 3 * w * h  # SwiGLU
             + w + 1  # gate
             + 2 * cfg.r_max * w)  # step and remaining embeddings
    readout = 2 * w * w + w * d
    F = cfg.controller_features
    controller = (F * 2 * w + 2 * w) + (2 * w * w + w) + w * w + 2 * cfg.n_actions
    controller += d * w if cfg.controller_source is not None else 0  # P_ctrl
    controller += w * w if cfg.controller_bank else 0  # BankMatch.W_bank
    out = {"workspace": bank + cfg.n_edit_blocks * block + readout, "controller": controller}
    if cfg.router:  # the head (d [+ 1] -> A, with bias), and the token table [V, A] with router_token
        out["router"] = ((d + (1 if cfg.router_ngram > 0 else 0) + 1) * cfg.n_actions
                         + (cfg.vocab_size * cfg.n_actions if cfg.router_token else 0))
    return out


# ---------------------------------------------------------------------- per-token ops
def action_editor_ops(cfg: PrismeConfig, k: int, T: int, optimised: bool | str = False, slot_kv_ready: bool = True,
                      dense: bool | None = None, tables: bool = False) -> dict[str, int]:
    """Editor ops of one action of k slots at context T.

    Args:
        k: slots the action edits (1 single, 2 pair, M DENSE).
        optimised: the column: False (the seed's), True (the optimised modules: the editor as the seed's) or
            `SLOT_KV_CACHE` (and the editor's slot K/V cache: `ExecutionOptions.column`). There a sparse
            action whose position has no slot K/V cache yet (`slot_kv_ready=False`: its first sparse action, or the
            first after a DENSE one) projects all M slots in every block first; DENSE actions always take the
            seed's path.
        dense: whether this is the DENSE action (default: k == M; pass it explicitly when M == 2).
        tables: the bank is kept as ids and read through its tables (`reads_through_tables`): the source attention
            over T entries becomes `id_read_attention_ops` (products with the tables, gathers over T).
    """
    w, M, B_e = cfg.w, cfg.n_slots, cfg.n_edit_blocks
    dense = k == M if dense is None else dense
    per_slot_kv = 4 * w * w  # K and V projections of one slot
    if optimised == SLOT_KV_CACHE and not dense:  # blocks >= 1 project the action's slots at their input;
        # every block refreshes them after
        slot_kv = ((B_e - 1) * k + B_e * k + (0 if slot_kv_ready else B_e * M)) * per_slot_kv
    else:  # every block projects all M slots
        slot_kv = B_e * M * per_slot_kv
    return {
        "editor_source_attn": k * B_e * (4 * w * w + (sum(id_read_attention_ops(cfg, T)) if tables else 4 * T * w)),
        #   q, o (w x w) + QK^T and AV over T keys (or the tables' products and T gathers)
        "editor_slot_attn": slot_kv + k * B_e * (4 * w * w + 4 * M * w),  # + q, o + QK^T and AV over M slots
        "editor_ffn": k * B_e * 6 * w * cfg.editor_hidden,  # SwiGLU w -> 2 h_e, h_e -> w
        "editor_gate": k * B_e * 2 * w,  # w -> 1
    }


def controller_step_ops(cfg: PrismeConfig, optimised: bool = False) -> int:
    """One controller step: state MLP F -> 2w -> w and the W_act projection of A summaries (M slots if optimised)."""
    w = cfg.w
    n_proj = cfg.n_slots if optimised else cfg.n_actions
    return 2 * (n_proj * w * w + cfg.controller_features * 2 * w + 2 * w * w)


def readout_ops(cfg: PrismeConfig, optimised: bool = False) -> int:
    """W_q z, attention reads of S and S0 over M slots (keys W_r S, or folded into the query), and U."""
    w, M = cfg.w, cfg.n_slots
    if optimised:
        return 2 * w * w + 2 * w * w + 2 * (4 * M * w) + 2 * w * cfg.d_model
    return 2 * w * w + 2 * (2 * M * w * w + 4 * M * w) + 2 * w * cfg.d_model


def backbone_ops(cfg: PrismeConfig, T: int) -> dict[str, int]:
    """The backbone's three terms for one new token at context T (it attends to `attended_keys` of them), and
    `backbone_key_shift` with a key shift (W_s of the previous position's normed input, every layer)."""
    shift = key_shift_params(cfg)
    out = {
        "backbone_linear": 2 * (backbone_params(cfg, non_embedding=True) - shift),
        "backbone_attention": cfg.n_layer * 4 * attended_keys(cfg, T) * cfg.d_model,  # QK^T, AV: n_head heads of hd
        "lm_head": 2 * cfg.d_model * cfg.vocab_size,
    }
    if cfg.key_shift:
        out["backbone_key_shift"] = 2 * shift
    if cfg.copy_head:
        out["copy_head"] = copy_head_ops(cfg, T)
    return out


def copy_head_ops(cfg: PrismeConfig, T: int) -> int:
    """The copy head (`cfg.copy_head`, prisme.model.copy) at one position of context T, priced as it runs: its matches
    are a lookup, not attention. Per earlier position one id comparison and one add (the match lengths' update),
    one table read and add (the pointer's score) and one add of its weight into its token's probability (3 (T - 1),
    no matmul: a named allowance in the tie to counted FLOPs); the gate's stream projection (2 d s) and MLP
    (2 (F + s) h + 2 h); the mix and the model-copy agreement (2 V). 0 without a copy head."""
    if not cfg.copy_head:
        return 0
    s, h = cfg.copy_stream, cfg.copy_hidden
    return 3 * (T - 1) + 2 * cfg.d_model * s + 2 * (COPY_FEATURES + s) * h + 2 * h + 2 * cfg.vocab_size


def finish_row(row: dict[str, int], cfg: PrismeConfig) -> dict[str, int]:
    comps = components(cfg)
    row = {c: int(row.get(c, 0)) for c in comps}
    row["backbone"] = sum(row[c] for c in comps if c in BACKBONE_TERMS)
    row["workspace"] = sum(row[c] for c in comps if c not in BACKBONE_TERMS)
    row["total"] = row["backbone"] + row["workspace"]
    return row


def token_ops(cfg: PrismeConfig, T: int, ks: Sequence[int] = (), controller_steps: int | None = None,
              optimised: bool | str = False, dense: Sequence[bool] | None = None, router: bool = False,
              decode: DecodeOptions = PROJECTED) -> dict[str, int]:
    """Ops for one generated token at context T whose workspace applied actions of `ks` slots each, in order.

    Args:
        ks: slots per applied action (empty: no edit).
        controller_steps: controller evaluations (default min(n + 1, r_max), the seed's rows; 0 for forced runs).
        optimised: the column (`action_editor_ops`); the slot K/V cache's state is followed through the actions.
        dense: per action, whether it is DENSE (default: k == M).
        router: the router decided step 0 (`cfg.router` policies): the position pays the router and the bank
            whether it edits or not; `controller_steps` then counts the controller's evaluations from step 1 on.
        decode: the decode state's options (`bank_ops`).
    Returns:
        The components (`components(cfg)`: seed 000's ten, plus `bank_shift` with a shifted bank) plus `backbone`,
        `workspace` and `total`. No workspace term is charged when `ks` is
        empty and `controller_steps` is 0 (the backbone alone).
    """
    T = _check_T(cfg, T)
    ks = [int(k) for k in ks]
    if any(not 1 <= k <= cfg.n_slots for k in ks):
        raise ValueError(f"slots per action must lie in [1, M={cfg.n_slots}], got {ks}")
    dense = [k == cfg.n_slots for k in ks] if dense is None else [bool(x) for x in dense]
    if len(dense) != len(ks):
        raise ValueError(f"dense flags ({len(dense)}) must match the actions ({len(ks)})")
    row = backbone_ops(cfg, T)
    n = len(ks)
    steps = min(n + 1, cfg.r_max) if controller_steps is None else int(controller_steps)
    if steps < 0:
        raise ValueError(f"controller_steps must be >= 0, got {steps}")
    if router and not cfg.router:
        raise ValueError(f"router=True prices a router, but {cfg.name!r} has none (cfg.router=False)")
    if n == 0 and steps == 0 and not router:
        return finish_row(row, cfg)
    tables = reads_through_tables(cfg, T, decode, router, n, steps, optimised)  # the deployed step: `IdRead`
    row.update(bank_ops(cfg, T, n > 0 or steps > 0, decode, tables))
    if router:
        row["router"] = router_ops(cfg, T)
    ready = False  # optimised path: does the position hold its slot K/V cache?
    for k, is_dense in zip(ks, dense):
        for name, v in action_editor_ops(cfg, k, T, optimised, ready, is_dense, tables).items():
            row[name] = row.get(name, 0) + v
        ready = not is_dense
    row["controller"] = steps * controller_step_ops(cfg, bool(optimised))
    if steps > 0 and cfg.controller_source is not None:
        row["controller_input"] = controller_input_ops(cfg)
    if steps > 0 and cfg.controller_bank:
        row["controller_bank"] = controller_bank_ops(cfg, T)
    if steps > 0 and cfg.controller_entropy:
        row["controller_entropy"] = controller_entropy_ops(cfg)
    if n > 0:
        row["readout"] = readout_ops(cfg, bool(optimised))
    return finish_row(row, cfg)


def seed_rows(cfg: PrismeConfig, T: int, optimised: bool | str = False) -> dict[str, dict[str, int]]:
    """The five rows of seed 000 for any config (dense16 = n DENSE actions of all M slots)."""
    rows = {}
    for name, (n, k) in SEED_ROWS.items():
        dense = name.endswith("dense16")
        k = cfg.n_slots if dense else k
        rows[name] = token_ops(cfg, T, [k] * n, controller_steps=0 if n == 0 else None, optimised=optimised,
                               dense=[dense] * n)
    return rows


def action_cost_proxy(cfg: PrismeConfig, T: int | None = None, optimised: bool | str = False) -> list[float]:
    """Per controller action: (editor ops of that action + one controller step) / backbone-only total, at T
    (default `cfg.cost_context`). This is the price vector the controller's `select` uses (`model.action_cost`,
    seed column). The optimised column prices an action on a position that already holds its slot K/V cache."""
    T = _check_T(cfg, cfg.cost_context if T is None else T)
    base = sum(backbone_ops(cfg, T).values())
    step = controller_step_ops(cfg, bool(optimised))
    out = []
    for a in range(cfg.n_actions):
        k = 1 if a < cfg.n_slots else 2
        out.append((sum(action_editor_ops(cfg, k, T, optimised, dense=False).values()) + step) / base)
    return out


def cost_table(cfg: PrismeConfig, T: int, optimised: bool | str = False) -> dict[str, Any]:
    """Seed 000's JSON layout: config, T, assumptions, rows (five named rows), action_cost_proxy."""
    T = _check_T(cfg, T)
    return {"config": cfg.name, "T": T, "assumptions": SEED_ASSUMPTIONS if not optimised
            else OPTIMISED_ASSUMPTIONS + (SLOT_KV_ASSUMPTIONS if optimised == SLOT_KV_CACHE else ""),
            "rows": seed_rows(cfg, T, optimised), "action_cost_proxy": action_cost_proxy(cfg, T, optimised)}


def cost_document(cfg: PrismeConfig, T: int, optimised: bool | str = False) -> dict[str, Any]:
    """What `prisme costs --json` prints: `cost_table` (the seed column), plus, with `optimised`, the optimised
    column as `optimised_rows`, `optimised_action_cost_proxy` and `optimised_assumptions` next to it."""
    doc = cost_table(cfg, T)
    if optimised:
        opt = cost_table(cfg, T, optimised=optimised)
        doc["optimised_rows"] = opt["rows"]
        doc["optimised_action_cost_proxy"] = opt["action_cost_proxy"]
        doc["optimised_assumptions"] = opt["assumptions"]
    return doc
