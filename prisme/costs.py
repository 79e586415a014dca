"""Analytic cost model: operations per generated token, one named term per component (seed 000, SPEC §6).

Conventions (the seed's):
  * one multiply-add = 2 ops; softmax, norms and activations are ignored (O(dim), not O(dim^2)), except that norm
    gains count in `backbone_linear` (2 ops per gain) because that term is 2 x non-embedding parameters;
  * decode step: the backbone attends over the whole context T (KV cache); the LM head is included;
  * the source bank is incremental: K, V and z of the new position only (3 projections d -> w);
  * the editor reads the whole bank (T keys) for every edited slot in every block (`editor_source_attn`);
  * seed accounting (`optimised=False`): every block refreshes the K/V of all M slots of the position for every
    action; the controller projects all A action summaries; the readout projects the M slots of both states;
  * optimised accounting (`optimised=True`, what `cfg.optimised` models run): slot K/V are computed once per edited
    position (all M slots, every block), then only for the slots an action changes (its k slots in blocks >= 1,
    and a refresh of its k slots in every block after it; DENSE actions keep the seed's path); the controller
    projects the M slots and averages pairs (M w^2 instead of A w^2); the readout folds W_r into its query
    (2 w^2 once instead of 2 M w^2 per state).

Sources: seed 000 (cost table for prisme_103m at T = 512); SPEC §6. `tests/test_costs.py` checks every integer of
the seed, ties each term to FLOPs counted on the real modules, and parameter counts to `numel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import PrismeConfig

COMPONENTS = ("backbone_linear", "backbone_attention", "lm_head", "bank_projection", "editor_source_attn",
              "editor_slot_attn", "editor_ffn", "editor_gate", "controller", "readout")
BACKBONE = COMPONENTS[:3]
SEED_ROWS = {  # name: (n actions, k slots per action); k = 0 means no workspace
    "backbone_only": (0, 0),
    "4_actions_k1": (4, 1),
    "4_actions_k2": (4, 2),
    "8_actions_k2": (8, 2),
    "8_actions_dense16": (8, 16),
}


# ---------------------------------------------------------------------- parameter counts
def backbone_params(cfg: PrismeConfig, non_embedding: bool = False) -> int:
    """Backbone parameters from the config alone (tied head counted once)."""
    d, L, hd, f = cfg.d_model, cfg.n_layer, cfg.head_dim, cfg.ffn_hidden
    qkv_out = (cfg.n_head + 2 * cfg.n_kv_head) * hd
    if cfg.family == "llama":
        per_layer = d * qkv_out + cfg.n_head * hd * d + 3 * d * f + 2 * d
        final_norm = d
    else:  # biased linears, LayerNorm with bias
        per_layer = (d * qkv_out + qkv_out) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        final_norm = 2 * d
    n = L * per_layer + final_norm
    if non_embedding:
        return n
    n += cfg.vocab_size * d
    if cfg.family == "gpt2":
        n += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        n += cfg.vocab_size * d
    return n


def workspace_params(cfg: PrismeConfig) -> dict[str, int]:
    """Parameters of the workspace modules by group, from the config alone."""
    if not cfg.use_workspace:
        return {"workspace": 0, "controller": 0}
    d, w, M, h = cfg.d_model, cfg.w, cfg.n_slots, cfg.editor_hidden
    bank = d + 3 * d * w + M * w  # bank_norm, W_K, W_V, P, slot_embed
    block = (3 * w  # three RMSNorm gains
             + 2 * w * w  # source-attention q, o
             + 4 * w * w  # slot-attention q, k, v, o
             + 3 * w * h  # SwiGLU
             + w + 1  # gate
             + 2 * cfg.r_max * w)  # step and remaining embeddings
    readout = 2 * w * w + w * d
    F = cfg.controller_features
    controller = (F * 2 * w + 2 * w) + (2 * w * w + w) + w * w + 2 * cfg.n_actions
    return {"workspace": bank + cfg.n_edit_blocks * block + readout, "controller": controller}


# ---------------------------------------------------------------------- per-token ops
def action_editor_ops(cfg: PrismeConfig, k: int, T: int, optimised: bool = False,
                      slot_kv_ready: bool = True) -> dict[str, int]:
    """Editor ops of one action of k slots at context T.

    Optimised: a sparse action whose position has no slot K/V cache yet (`slot_kv_ready=False`) first computes all
    M slots' K/V in every block; DENSE (k = M) always takes the seed's path.
    """
    w, M, B_e = cfg.w, cfg.n_slots, cfg.n_edit_blocks
    per_slot_kv = 4 * w * w  # K and V projections of one slot
    if optimised and k < M:
        slot_kv = ((B_e - 1) * k + B_e * k + (0 if slot_kv_ready else B_e * M)) * per_slot_kv
    else:
        slot_kv = B_e * M * per_slot_kv
    return {
        "editor_source_attn": k * B_e * (4 * w * w + 4 * T * w),
        "editor_slot_attn": slot_kv + k * B_e * (4 * w * w + 4 * M * w),
        "editor_ffn": k * B_e * 6 * w * cfg.editor_hidden,
        "editor_gate": k * B_e * 2 * w,
    }


def controller_step_ops(cfg: PrismeConfig, optimised: bool = False) -> int:
    """One controller step: state MLP F -> 2w -> w and the W_act projection of A summaries (M slots if optimised)."""
    w = cfg.w
    n_proj = cfg.n_slots if optimised else cfg.n_actions
    return 2 * (n_proj * w * w + cfg.controller_features * 2 * w + 2 * w * w)


def readout_ops(cfg: PrismeConfig, optimised: bool = False) -> int:
    """W_q z, attention reads of S and S0 over M slots, and U."""
    w, M = cfg.w, cfg.n_slots
    if optimised:
        return 2 * w * w + 2 * w * w + 2 * (4 * M * w) + 2 * w * cfg.d_model
    return 2 * w * w + 2 * (2 * M * w * w + 4 * M * w) + 2 * w * cfg.d_model


def backbone_ops(cfg: PrismeConfig, T: int) -> dict[str, int]:
    return {
        "backbone_linear": 2 * backbone_params(cfg, non_embedding=True),
        "backbone_attention": cfg.n_layer * 4 * T * cfg.d_model,
        "lm_head": 2 * cfg.d_model * cfg.vocab_size,
    }


def _finish(row: dict[str, int]) -> dict[str, int]:
    row = {c: int(row.get(c, 0)) for c in COMPONENTS}
    row["backbone"] = sum(row[c] for c in BACKBONE)
    row["workspace"] = sum(row[c] for c in COMPONENTS if c not in BACKBONE)
    row["total"] = row["backbone"] + row["workspace"]
    return row


def token_ops(cfg: PrismeConfig, T: int, ks: Sequence[int] = (), controller_steps: int | None = None,
              readout: bool | None = None, optimised: bool = False) -> dict[str, int]:
    """Ops for one generated token at context T whose workspace applied actions of `ks` slots each.

    Args:
        ks: slots per applied action (empty: no edit).
        controller_steps: controller evaluations (default min(n + 1, r_max), the seed's rows; 0 for forced runs).
        readout: whether the readout ran (default: n >= 1).
        None of the workspace terms are charged when `ks` is empty and `controller_steps` is 0 (backbone only).
    """
    row = backbone_ops(cfg, T)
    n = len(ks)
    steps = min(n + 1, cfg.r_max) if controller_steps is None else controller_steps
    if n == 0 and steps == 0:
        return _finish(row)
    row["bank_projection"] = 3 * 2 * cfg.d_model * cfg.w
    ready = False  # optimised path: does the position hold its slot K/V cache?
    for k in ks:
        for name, v in action_editor_ops(cfg, k, T, optimised, ready).items():
            row[name] = row.get(name, 0) + v
        ready = k < cfg.n_slots
    row["controller"] = steps * controller_step_ops(cfg, optimised)
    if n > 0 if readout is None else readout:
        row["readout"] = readout_ops(cfg, optimised)
    return _finish(row)


def seed_rows(cfg: PrismeConfig, T: int, optimised: bool = False) -> dict[str, dict[str, int]]:
    """The five rows of seed 000 for any config (dense16 = n DENSE actions of all M slots)."""
    rows = {}
    for name, (n, k) in SEED_ROWS.items():
        k = cfg.n_slots if name.endswith("dense16") else k
        rows[name] = token_ops(cfg, T, [k] * n, controller_steps=0 if n == 0 else None, optimised=optimised)
    return rows


def action_cost_proxy(cfg: PrismeConfig, T: int | None = None, optimised: bool = False) -> list[float]:
    """Per controller action: (editor ops of that action + one controller step) / backbone-only total, at T
    (default `cfg.cost_context`). This is the price vector the controller's `select` uses."""
    T = cfg.cost_context if T is None else T
    base = sum(backbone_ops(cfg, T).values())
    step = controller_step_ops(cfg, optimised)
    out = []
    for a in range(cfg.n_actions):
        k = 1 if a < cfg.n_slots else 2
        out.append((sum(action_editor_ops(cfg, k, T, optimised).values()) + step) / base)
    return out


ASSUMPTIONS = __doc__.split("Sources:")[0].strip()


def cost_table(cfg: PrismeConfig, T: int, optimised: bool = False) -> dict:
    """Seed 000's JSON layout: config, T, assumptions, rows (five named rows), action_cost_proxy."""
    return {"config": cfg.name, "T": T, "assumptions": ASSUMPTIONS,
            "rows": seed_rows(cfg, T, optimised), "action_cost_proxy": action_cost_proxy(cfg, T, optimised)}


# ---------------------------------------------------------------------- cost of actual traces
@dataclass
class TraceCost:
    """Ops of a batch of generated/evaluated positions under an actual action trace."""

    total_ops: float  # summed over positions
    n_positions: int
    backbone_ops: float  # what the backbone alone would have cost on the same positions
    by_component: dict[str, float]

    @property
    def ops_per_token(self) -> float:
        return self.total_ops / max(self.n_positions, 1)

    @property
    def relative(self) -> float:
        """Total ops over the backbone-only ops of the same positions."""
        return self.total_ops / max(self.backbone_ops, 1.0)


def trace_cost(cfg: PrismeConfig, actions, contexts, controller_steps=None, optimised: bool = False) -> TraceCost:
    """Cost of actual traces by SPEC §6's rules.

    Args:
        actions: `[N, R]` applied action ids per position (STOP = A; DENSE = A+1), or None for the backbone alone.
        contexts: `[N]` context length of each position (t + 1: its own keys).
        controller_steps: `[N]` controller evaluations per position (None or zeros for forced policies). A position
            with n >= 1 edits pays its actions, its controller steps, the bank projection and the readout; one the
            controller stopped at once pays the bank projection and one controller step; forced policies pay no
            controller.
    """
    import torch

    contexts = torch.as_tensor(contexts).flatten().tolist()
    N = len(contexts)
    comp = dict.fromkeys(COMPONENTS, 0.0)
    base = 0.0
    acts = None if actions is None else torch.as_tensor(actions).reshape(N, -1).tolist()
    steps = [0] * N if controller_steps is None else torch.as_tensor(controller_steps).flatten().tolist()
    cache: dict[tuple, dict[str, int]] = {}
    for i, T in enumerate(contexts):
        ks = () if acts is None else tuple(_k_of(cfg, a) for a in acts[i] if a != cfg.stop_action)
        key = (int(T), ks, int(steps[i]))
        if key not in cache:
            cache[key] = token_ops(cfg, int(T), ks, controller_steps=int(steps[i]), optimised=optimised)
            if acts is not None and not ks and int(steps[i]) == 0:  # forced policy, all STOP: the bank still runs
                cache[key]["bank_projection"] = 3 * 2 * cfg.d_model * cfg.w
                cache[key] = _finish(cache[key])
        row = cache[key]
        for c in COMPONENTS:
            comp[c] += row[c]
        base += row["backbone"]
    total = sum(comp.values())
    return TraceCost(total_ops=total, n_positions=N, backbone_ops=base, by_component=comp)


def _k_of(cfg: PrismeConfig, a: int) -> int:
    if a == cfg.dense_action:
        return cfg.n_slots
    if not 0 <= a < cfg.n_actions:
        raise ValueError(f"action id {a} is not an edit (valid: [0, {cfg.n_actions}) or DENSE={cfg.dense_action})")
    return 1 if a < cfg.n_slots else 2
