"""The three stages' objectives (SPEC §5), used by `prisme.training.trainer`.

1. `BackboneObjective`: next-token cross-entropy of `model(tokens)` (the exact bypass; the workspace is not touched).
2. `WorkspaceObjective`: backbone frozen (unless `train_backbone_in_workspace_stage`); each position gets a random
   budget in [min_budget, max_budget] and random actions (singles and pairs, optionally DENSE), STOP after its
   budget; loss = CE of the corrected logits (+ `deep_supervision` x CE after every intermediate step).
3. `ControllerObjective` (and the router stage's `RouterObjective`), in `prisme.training.oracle_objectives`: value
   heads regressed on the oracle's true loss drops. Only these training stages execute candidate edits; the
   deployed controller and router never do.

Each stage's objective is its `prisme.training.stages.StageSpec.objective`, built as `objective(model, scfg)`;
`StageSettings` is what it reads of the stage's `StageConfig`.

Notation: b rows of one micro-batch on one rank, T seq_len, P oracle positions per sequence, A actions, R forced
steps. An objective owns its stage's randomness and loss; see the section comment below for the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn as nn

from prisme.data.text import IGNORE_INDEX
from prisme.model.oracle import token_ce


class StageSettings(Protocol):
    """What an objective reads of its stage's `prisme.training.config.StageConfig` (every field documented there).
    The config names each stage's objective (`StageConfig.spec.objective`), so the objectives name only this."""

    seed: int
    train_backbone_in_workspace_stage: bool
    backbone_aux_weight: float
    workspace_grad_to_backbone: bool
    deep_supervision: float
    min_budget: int
    max_budget: int | None
    p_dense: float
    workspace_positions: int
    oracle_positions: int
    oracle_greedy: float
    value_clip: float
    risk_weight: float
    unlabelled_value: str

    @property
    def prev_token_probe_weight(self) -> float: ...


def _ce_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed next-token CE over positions with a label; logits `[..., V]`, y `[...]`."""
    return token_ce(logits, y, reduction="sum", float32=True)


# -------------------------------------------------------------------------------------------------------- objectives
# An objective owns the stage's randomness and loss. `sample` draws the random inputs of a whole global batch
# (rows first, so they shard with the tokens); `denominators` counts over the whole global batch; `forward` runs on
# a shard and returns (loss, stats) with loss = sum of its terms / global counts; stats are sums over the shard
# that `summarise` turns into metrics after summing over micro-batches and ranks.


class BackboneObjective(nn.Module):
    """Stage 1: next-token CE of the backbone (the model's exact bypass path)."""

    def __init__(self, model: nn.Module, scfg: StageSettings):
        super().__init__()
        self.model = model

    def sample(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
        return {}

    def denominators(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"tokens": max(1, int((y != IGNORE_INDEX).sum()))}

    def forward(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor],
                denom: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ce = _ce_sum(self.model(x).logits, y)  # x, y [b, T]
        return ce / denom["tokens"], {"ce": ce.detach(), "n": (y != IGNORE_INDEX).sum().to(ce)}

    @staticmethod
    def summarise(s: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"loss": float(s["ce"] / s["n"].clamp(min=1))}


class CopyObjective(nn.Module):
    """The copy stage: next-token CE of the model's own output (`model(x)`: the backbone's head mixed with the copy
    head's distribution, `prisme.model.copy`) at every position, the dense gradient a far read needs; the backbone
    frozen, or learning beside it (`train_backbone_in_workspace_stage`: the read present from the first step when the
    stage starts from a fresh model). Reports the backbone head's own loss on the same targets and the mean gate."""

    def __init__(self, model: nn.Module, scfg: StageSettings):
        super().__init__()
        if not model.cfg.copy_head:
            raise ValueError(f"the copy stage trains a copy head, but {model.cfg.name!r} has copy_head=False: build "
                             f"the model with copy_head=True (prisme train --rebase --set model.copy_head=true)")
        self.model = model

    def sample(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
        return {}

    def denominators(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"tokens": max(1, int((y != IGNORE_INDEX).sum()))}

    def forward(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor],
                denom: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = self.model
        H = model.backbone(x)  # [b, T, d]
        logits = model.backbone.head(H)
        mixed, g = model.copy.mix(logits, model.copy_inputs(x), H)
        ce = _ce_sum(mixed, y)
        with torch.no_grad():
            labelled = (y != IGNORE_INDEX).float()
            stats = {"ce": ce.detach(), "ce_backbone": _ce_sum(logits.detach(), y), "n": labelled.sum(),
                     "gate": (g.detach().float() * labelled).sum()}
        return ce / denom["tokens"], stats

    @staticmethod
    def summarise(s: dict[str, torch.Tensor]) -> dict[str, float]:
        n = s["n"].clamp(min=1)
        out = {"loss": float(s["ce"] / n), "loss_backbone": float(s["ce_backbone"] / n)}
        return out | {"gain": out["loss_backbone"] - out["loss"], "gate_mean": float(s["gate"] / n)}


class _HeadCall(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, H: torch.Tensor) -> torch.Tensor:
        return self.backbone.head(H)


def _head_without_weight_grads(backbone: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`backbone.head` whose weights (final norm, tied embedding) take no gradient; H still does."""
    call = _HeadCall(backbone)
    params = {f"backbone.{n}": p.detach() for n, p in backbone.named_parameters()}
    return lambda H: torch.func.functional_call(call, params, (H,))


class WorkspaceObjective(nn.Module):
    """Stage 2: CE of the corrected logits under random forced action sequences."""

    def __init__(self, model: nn.Module, scfg: StageSettings):
        super().__init__()
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.train_backbone = scfg.train_backbone_in_workspace_stage
        self.aux = scfg.backbone_aux_weight if self.train_backbone else 0.0
        self.isolate = self.train_backbone and not scfg.workspace_grad_to_backbone  # the workspace reads H.detach()
        self.aux_prev = scfg.prev_token_probe_weight
        if self.aux_prev > 0:  # SPEC §5 lesson: make H[t] carry token t-1 so the bank has something to match
            self.prev_probe = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # trained and checkpointed here
            g = torch.Generator().manual_seed(scfg.seed + 4)
            with torch.no_grad():
                self.prev_probe.weight.copy_(torch.randn(cfg.vocab_size, cfg.d_model, generator=g) * cfg.d_model**-0.5)
        self.ds = scfg.deep_supervision
        self.p_dense = scfg.p_dense
        self.positions = scfg.workspace_positions
        self.lo, self.hi = scfg.min_budget, scfg.max_budget or cfg.r_max
        if self.hi > cfg.r_max:
            raise ValueError(f"StageConfig.max_budget={self.hi} exceeds the model's r_max={cfg.r_max}")

    def sample(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
        """Budgets `[B, T]` in [lo, hi] and actions `[B, T, hi]`: random singles/pairs (or DENSE), STOP after."""
        cfg, (B, T), R = self.cfg, x.shape, self.hi
        budget = torch.randint(self.lo, self.hi + 1, (B, T), generator=g)  # [B, T]
        actions = torch.randint(0, cfg.n_actions, (B, T, R), generator=g)  # [B, T, R]
        if self.p_dense > 0:
            dense = torch.rand(B, T, R, generator=g) < self.p_dense
            actions = torch.where(dense, torch.full_like(actions, cfg.dense_action), actions)
        late = torch.arange(R) >= budget.unsqueeze(-1)  # [B, T, R]
        actions = actions.masked_fill(late, cfg.stop_action)
        out = {"budget": budget, "actions": actions}
        if self.positions:  # P of each row's labelled positions, uniformly without replacement
            labelled = y != IGNORE_INDEX  # [B, T]
            order = torch.rand(B, T, generator=g).masked_fill(~labelled, 2.0).argsort(1)[:, :self.positions]
            out["trained"] = torch.zeros(B, T, dtype=torch.bool).scatter_(1, order, True) & labelled  # [B, T]
        return out

    @staticmethod
    def _trained(y: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labels the workspace trains on: y where `sample` drew positions (`workspace_positions`), else all."""
        return y.masked_fill(~extra["trained"], IGNORE_INDEX) if "trained" in extra else y

    def denominators(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        d = {"all": max(1, int((y != IGNORE_INDEX).sum()))}  # every label (the backbone's own loss, aux)
        y = self._trained(y, extra)
        valid = y != IGNORE_INDEX  # [B, T]
        d["tokens"] = max(1, int(valid.sum()))
        if self.aux_prev > 0:
            d["prev"] = max(1, x.shape[0] * (x.shape[1] - 1))  # positions t >= 1
        if self.ds > 0:  # (position, step) pairs whose state after step r is not yet final
            d["ds"] = max(1, sum(int((valid & (extra["budget"] > r + 1)).sum()) for r in range(self.hi - 1)))
        return d

    def forward(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor],
                denom: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model, cfg = self.model, self.cfg
        actions, budget = extra["actions"], extra["budget"]  # [b, T, R], [b, T]
        with torch.set_grad_enabled(self.train_backbone and torch.is_grad_enabled()):
            st_own = model.streams(x)  # H [b, T, d] and the workspace's source streams
        H_own = st_own.H
        st = st_own.detach() if self.isolate else st_own
        H = st.H
        head = _head_without_weight_grads(model.backbone) if self.isolate else None
        y_all, y = y, self._trained(y, extra)  # the backbone's own loss (aux) reads every label
        ctx, actions, budget, y = self._labelled_queries(st, actions, budget, y)  # [b, Tq, ...], Tq <= T
        # Under autograd the slot K/V cache costs more than it saves (each write is an out-of-place copy of the whole
        # cache, and so is its backward): train on the reference path, which computes the same function.
        S, slot_kv = ctx.S0, None if torch.is_grad_enabled() else model.new_slot_kv(ctx.S0)
        ds_sum = H.new_zeros((), dtype=torch.float32)
        gate_sum = [H.new_zeros((), dtype=torch.float32) for _ in range(cfg.n_edit_blocks)]
        gate_n = H.new_zeros((), dtype=torch.float32)
        for r in range(actions.shape[-1]):
            S, info = model.apply_action(S, ctx, actions[:, :, r], r, (budget - r - 1).clamp(min=0), slot_kv)
            slot_kv = info.slot_kv
            if info.n_positions:
                gate_n = gate_n + info.n_positions
                for i, gm in enumerate(info.gate_mean):
                    gate_sum[i] = gate_sum[i] + gm.detach().float() * info.n_positions
            if self.ds > 0 and r < actions.shape[-1] - 1:
                more = budget > r + 1  # [b, T] positions whose final state is later
                logits_r, _ = model.logits_from_state(S, ctx, more, head)
                ds_sum = ds_sum + _ce_sum(logits_r, y.masked_fill(~more, IGNORE_INDEX))
        edited = (actions != cfg.stop_action).any(-1)  # [b, Tq]
        logits, delta = model.logits_from_state(S, ctx, edited, head)
        ce = _ce_sum(logits, y)
        loss = ce / denom["tokens"]
        if self.ds > 0:
            loss = loss + self.ds * ds_sum / denom["ds"]
        with torch.no_grad():
            ce_bb = _ce_sum(model.output(ctx.H.detach(), ctx.copy), y)
        if self.aux > 0:
            loss = loss + self.aux * _ce_sum(model.output(H_own, model.copy_inputs(x)), y_all) / denom["all"]
        prev_ce = H.new_zeros((), dtype=torch.float32)
        if self.aux_prev > 0:
            prev_ce = _ce_sum(self.prev_probe(H_own[:, 1:]), x[:, :-1])  # H[t] [b, T-1, d] -> token t-1
            loss = loss + self.aux_prev * prev_ce / denom["prev"]
        with torch.no_grad():
            e = edited.float()
            s_rel = ((S - ctx.S0).flatten(-2).norm(dim=-1) / ctx.S0.flatten(-2).norm(dim=-1).clamp(min=1e-12))
            d_rel = delta.norm(dim=-1) / ctx.H.norm(dim=-1).clamp(min=1e-12)  # [b, Tq]
            stats = {"ce": ce.detach(), "ce_backbone": ce_bb, "n": (y != IGNORE_INDEX).sum().float(),
                     "n_edited": e.sum(), "s_rel": (s_rel.float() * e).sum(), "delta_rel": (d_rel.float() * e).sum(),
                     "gate_n": gate_n, **{f"gate{i}": g for i, g in enumerate(gate_sum)}}
            if self.aux_prev > 0:
                stats["prev_ce"], stats["n_prev"] = prev_ce.detach(), H.new_tensor(float(x.shape[0] * (x.shape[1] - 1)))
        return loss, stats

    def _labelled_queries(self, st, actions: torch.Tensor, budget: torch.Tensor, y: torch.Tensor):
        """The workspace runs only where a label is: a position's workspace reads the bank and its own slots, never
        another position's, so positions without a label add nothing to the loss or its gradient. When some row has
        fewer labels than positions (MQAR: queries only), queries are the labelled positions of each row (padded
        with unlabelled ones to the longest row; their CE is ignored). Returns (ctx, actions, budget, y) at the
        queries `[b, Tq, ...]`."""
        model = self.model
        labelled = y != IGNORE_INDEX  # [b, T]
        b, T = y.shape
        P = max(1, int(labelled.sum(1).max()))
        if P == T:
            return model.context_from_H(st, st), actions, budget, y
        pos = torch.argsort((~labelled).to(torch.int8), dim=1, stable=True)[:, :P]  # [b, P] labelled first, in order
        rows = torch.arange(b, device=y.device).unsqueeze(1)  # [b, 1]
        ctx = model.context_from_H(st, st.index(rows, pos), query_pos=pos)
        return ctx, actions[rows, pos], budget[rows, pos], y[rows, pos]

    @staticmethod
    def summarise(s: dict[str, torch.Tensor]) -> dict[str, float]:
        n, ne, gn = s["n"].clamp(min=1), s["n_edited"].clamp(min=1), s["gate_n"].clamp(min=1)
        out = {"loss": float(s["ce"] / n), "loss_backbone": float(s["ce_backbone"] / n)}
        out["gain"] = out["loss_backbone"] - out["loss"]
        out["s_change"] = float(s["s_rel"] / ne)  # mean |S - S0| / |S0| at edited positions
        out["delta_ratio"] = float(s["delta_rel"] / ne)  # mean |delta| / |H| at edited positions
        if "prev_ce" in s:
            out["loss_prev_token"] = float(s["prev_ce"] / s["n_prev"].clamp(min=1))  # the aux_prev_token probe's CE
        for k in sorted(k for k in s if k.startswith("gate") and k != "gate_n"):
            out[f"{k}_mean"] = float(s[k] / gn)  # mean editor gate of block i over edited slots
        return out
