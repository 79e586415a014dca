"""The three stages' objectives (SPEC §5), used by `prisme.training.trainer`.

1. `BackboneObjective`: next-token cross-entropy of `model(tokens)` (the exact bypass; the workspace is not touched).
2. `WorkspaceObjective`: backbone frozen (unless `train_backbone_in_workspace_stage`); each position gets a random
   budget in [min_budget, max_budget] and random actions (singles and pairs, optionally DENSE), STOP after its
   budget; loss = CE of the corrected logits (+ `deep_supervision` x CE after every intermediate step).
3. `ControllerObjective`: backbone and workspace frozen. At sampled positions, for each step of a behaviour
   rollout, every candidate action is executed (the oracle) to get the true drop of that position's next-token
   loss dL_a = CE(S) - CE(apply(S, a)) `[.., A]`; `value` is regressed on dL (clipped at `value_clip` x scale,
   Huber on dL / scale: the targets are heavy-tailed) and `risk` on |value - dL|. Only this training stage executes
   candidate edits; the deployed controller never does.

Notation: b rows of one micro-batch on one rank, T seq_len, P oracle positions per sequence, A actions, R forced
steps. An objective owns its stage's randomness and loss; see the section comment below for the contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.data.text import IGNORE_INDEX
from prisme.model.oracle import candidate_losses, repeat_queries, token_ce

if TYPE_CHECKING:  # pragma: no cover
    from prisme.training.config import StageConfig


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

    def __init__(self, model: nn.Module, scfg: StageConfig):
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

    def __init__(self, model: nn.Module, scfg: StageConfig):
        super().__init__()
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.train_backbone = scfg.train_backbone_in_workspace_stage
        self.aux = scfg.backbone_aux_weight if self.train_backbone else 0.0
        self.isolate = self.train_backbone and not scfg.workspace_grad_to_backbone  # the workspace reads H.detach()
        self.aux_prev = scfg.aux_prev_token if scfg.stage == "workspace" else 0.0
        if self.aux_prev > 0:  # SPEC §5 lesson: make H[t] carry token t-1 so the bank has something to match
            self.prev_probe = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # trained and checkpointed here
            g = torch.Generator().manual_seed(scfg.seed + 4)
            with torch.no_grad():
                self.prev_probe.weight.copy_(torch.randn(cfg.vocab_size, cfg.d_model, generator=g) * cfg.d_model**-0.5)
        self.ds = scfg.deep_supervision
        self.p_dense = scfg.p_dense
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
        return {"budget": budget, "actions": actions}

    def denominators(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        valid = y != IGNORE_INDEX  # [B, T]
        d = {"tokens": max(1, int(valid.sum()))}
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
        y_all = y
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
            ce_bb = _ce_sum(model.backbone.head(ctx.H.detach()), y)
        if self.aux > 0:
            loss = loss + self.aux * _ce_sum(model.backbone.head(H_own), y_all) / denom["tokens"]
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


class ControllerObjective(nn.Module):
    """Stage 3: regress the controller's value on the oracle's true loss drops and its risk on the error."""

    def __init__(self, model: nn.Module, scfg: StageConfig):
        super().__init__()
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.P = scfg.oracle_positions
        self.greedy = scfg.oracle_greedy
        self.clip = scfg.value_clip
        self.risk_weight = scfg.risk_weight
        self.unlabelled_zero = scfg.unlabelled_value == "zero"
        self.max_budget = scfg.max_budget or cfg.r_max  # budgets of the behaviour rollouts: 1..max_budget
        if self.max_budget > cfg.r_max:
            raise ValueError(f"StageConfig.max_budget={self.max_budget} exceeds the model's r_max={cfg.r_max}")
        self.scale = 1.0  # dL scale (std at the start of the stage); set by `calibrate`, checkpointed

    # -------------------------------------------------------------------------------------------- randomness
    def sample(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
        """Budget (one per batch, as a `[B]` row tensor), position scores `[B, T]`, behaviour draws `[B, P, r_max]`."""
        cfg, (B, T) = self.cfg, x.shape
        P, R = min(self.P, T), cfg.r_max
        budget = torch.randint(1, self.max_budget + 1, (1,), generator=g).expand(B).clone()  # [B]
        return {"budget": budget, "scores": torch.rand(B, T, generator=g),
                "random_action": torch.randint(0, cfg.n_actions, (B, P, R), generator=g),
                "follow_oracle": torch.rand(B, P, R, generator=g) < self.greedy}

    def positions(self, y: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The P sampled positions `[b, P]` of each row (labelled ones first) and whether each has a label."""
        P = min(self.P, y.shape[1])
        labelled = y != IGNORE_INDEX  # [b, T]
        pos = (scores + labelled.to(scores.dtype)).topk(P, dim=1).indices  # [b, P]: labelled first, random order
        return pos, labelled.gather(1, pos)

    def denominators(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        _, valid = self.positions(y, extra["scores"])
        n = valid.numel() if self.unlabelled_zero else int(valid.sum())
        return {"targets": max(1, n * int(extra["budget"][0]) * self.cfg.n_actions)}

    # ----------------------------------------------------------------------------------------------- oracle
    def oracle_rollout(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor],
                       on_state: Callable[..., None]) -> None:
        """Walk a behaviour rollout at the sampled positions; at every state execute all A candidate actions.

        Calls `on_state(r, ctx, S, edits, taken, budget, dL, valid)` with dL `[b, P, A]` the true drop of the
        position's next-token CE for each action (0 at positions without a label with `unlabelled_value="zero"`,
        where every sampled position is then valid), then moves on by the oracle's best action (with probability
        `oracle_greedy`) or a random one.
        """
        model, cfg = self.model, self.cfg
        A, M = cfg.n_actions, cfg.n_slots
        b_budget = int(extra["budget"][0])
        with torch.no_grad():
            st = model.streams(x)  # H [b, T, d] and the source streams
            pos, valid = self.positions(y, extra["scores"])  # [b, P]
            b, P = pos.shape
            rows = torch.arange(b, device=x.device).unsqueeze(1)  # [b, 1]
            Hq, yq = st.H[rows, pos], y[rows, pos].masked_fill(~valid, 0)  # [b, P, d], [b, P]
            ctx = model.context_from_H(st, st.index(rows, pos), query_pos=pos)  # Tq = P
            rep = lambda t: t.repeat_interleave(A, dim=1)  # noqa: E731 - [b, P, ...] -> [b, P A, ...]
            ctx_a = repeat_queries(ctx, A)
            cand = torch.arange(A, device=x.device).repeat(P).expand(b, P * A)  # [b, P A]
            loss_cur = token_ce(model.backbone.head(Hq), yq, float32=True)  # [b, P]: nothing edited yet
            S = ctx.S0
            edits = torch.zeros(b, P, M, dtype=torch.long, device=x.device)
            taken = torch.zeros(b, P, A, dtype=torch.bool, device=x.device)
            budget = torch.full((b, P), b_budget, dtype=torch.long, device=x.device)
        # with unlabelled_value="zero", candidates run at labelled positions only: elsewhere dL = 0 is known, and the
        # behaviour rollout there applies just its chosen action
        zero = self.unlabelled_zero and not bool(valid.all())
        cand = torch.where(rep(valid), cand, cfg.stop_action) if zero else cand  # STOP: the editor skips them
        for r in range(b_budget):
            with torch.no_grad():
                S_c, _, loss_c = candidate_losses(model, S, ctx_a, cand, r, b_budget - r - 1, yq,
                                                  rep(valid) if zero else None, float32=True)  # [b, P, A] losses
                dL = loss_cur.unsqueeze(-1) - loss_c  # [b, P, A]
                if self.unlabelled_zero:  # no label: no edit there changes the scored loss
                    dL = dL.masked_fill(~valid.unsqueeze(-1), 0.0)
            on_state(r, ctx, S, edits, taken, budget, dL, torch.ones_like(valid) if self.unlabelled_zero else valid)
            with torch.no_grad():
                follow = extra["follow_oracle"][:, :P, r].to(x.device)
                rand = extra["random_action"][:, :P, r].to(x.device)
                a = torch.where(follow & valid, dL.argmax(-1), rand)  # [b, P]; no oracle to follow without a label
                S_next = S_c.view(b, P, A, *S_c.shape[2:])[rows, torch.arange(P, device=x.device), a]  # [b, P, M, w]
                if zero:  # unlabelled positions: run the behaviour action itself
                    S_u, _ = model.apply_action(S, ctx, a.masked_fill(valid, cfg.stop_action), r, b_budget - r - 1)
                    S_next = torch.where(valid[..., None, None], S_next, S_u)
                S = S_next
                loss_cur = loss_c.gather(-1, a.unsqueeze(-1)).squeeze(-1)
                edits = edits + model.action_slot_counts[a]
                taken = taken | F.one_hot(a, A).bool()

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor], init_heads: bool) -> float:
        """Set `scale` to the std of the oracle's dL on one batch (the value loss works on dL / scale).

        With `init_heads` (a fresh controller), also start the regressor from the best per-action constant: shrink
        the state MLP's output so the bilinear term is a tenth of the target scale, set b_v to the per-action mean
        of the residual target, and b_r so that the initial risk is the mean absolute residual.
        """
        ctrl = self.model.controller
        dls: list[torch.Tensor] = []
        bilinear: list[torch.Tensor] = []

        def on_state(r, ctx, S, edits, taken, budget, dL, valid):
            dls.append(dL[valid].double())  # [n, A]
            if init_heads:
                zc, match = self.model.controller_inputs(ctx)
                v = ctrl(zc, S, ctx.S0, edits, taken, torch.full_like(budget, r), budget, match).value - ctrl.b_v
                bilinear.append(v[valid].double())

        self.oracle_rollout(x, y, extra, on_state)
        d = torch.cat(dls)  # [N, A]
        std = float(d.std()) if d.numel() > 1 else 0.0
        self.scale = std if std > 0 and math.isfinite(std) else 1.0
        if init_heads and d.shape[0] > 0:
            t = d.clamp(-self.clip * self.scale, self.clip * self.scale)
            v0 = torch.cat(bilinear)  # [N, A]
            c = min(1.0, 0.1 * self.scale / max(float(v0.std()), 1e-30))
            last = ctrl.mlp[-1]
            last.weight.mul_(c)
            last.bias.mul_(c)
            resid = t - c * v0
            ctrl.b_v.copy_(resid.mean(0).to(ctrl.b_v))
            err = (resid - resid.mean(0)).abs().mean(0).clamp(min=1e-6 * self.scale)  # [A]
            ctrl.b_r.copy_((err + torch.log(-torch.expm1(-err))).to(ctrl.b_r))  # softplus^-1(err)
        return self.scale

    def forward(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor],
                denom: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sc = self.scale
        terms: list[torch.Tensor] = []
        st: dict[str, torch.Tensor] = {}

        def add(k: str, v: torch.Tensor) -> None:
            st[k] = st[k] + v if k in st else v

        def on_state(r, ctx, S, edits, taken, budget, dL, valid):
            steps = torch.full_like(budget, r)
            zc, match = self.model.controller_inputs(ctx)  # [b, P, w], [b, P, 2] (its own projections train here)
            pred = self.model.controller(zc, S, ctx.S0, edits, taken, steps, budget, match)  # value, risk [b, P, A]
            t = dL.float().clamp(-self.clip * sc, self.clip * sc)  # [b, P, A]
            v = pred.value.float()
            m = valid.unsqueeze(-1).float().expand_as(t)  # [b, P, A]
            err = (v.detach() - t).abs()
            v_loss = F.huber_loss(v / sc, t / sc, reduction="none", delta=1.0)
            r_loss = F.huber_loss(pred.risk.float() / sc, err / sc, reduction="none", delta=1.0)
            terms.append(((v_loss + self.risk_weight * r_loss) * m).sum())
            with torch.no_grad():
                add("v_se", ((v - t) ** 2 * m).sum())
                add("t_sum", (t * m).sum())
                add("t_sq", (t * t * m).sum())
                add("t_sum_a", (t * m).sum((0, 1)))
                add("t_sq_a", (t * t * m).sum((0, 1)))
                add("n_a", m.sum((0, 1)))
                add("r_se", ((pred.risk.float() - err) ** 2 * m).sum())
                add("e_sum", (err * m).sum())
                add("e_sq", (err * err * m).sum())
                best = dL.argmax(-1, keepdim=True)  # [b, P, 1]
                pick = v.argmax(-1, keepdim=True)
                vm = valid.float()
                add("top1", ((best == pick).squeeze(-1).float() * vm).sum())
                add("regret", ((dL.gather(-1, best) - dL.gather(-1, pick)).squeeze(-1).float() * vm).sum())
                add("best_dl", (dL.gather(-1, best).squeeze(-1).float() * vm).sum())
                add("states", vm.sum())

        self.oracle_rollout(x, y, extra, on_state)
        loss = torch.stack(terms).sum() / denom["targets"]
        return loss, st

    @staticmethod
    def summarise(s: dict[str, torch.Tensor]) -> dict[str, float]:
        n = s["n_a"].sum().clamp(min=1)
        n_a = s["n_a"].clamp(min=1)
        mse_const = s["t_sq"] / n - (s["t_sum"] / n) ** 2  # best single constant, chosen in hindsight
        mse_const_a = ((s["t_sq_a"] - s["t_sum_a"] ** 2 / n_a).sum()) / n  # best constant per action
        states = s["states"].clamp(min=1)
        out = {"loss": float(s["v_se"] / n), "value_mse": float(s["v_se"] / n),
               "value_mse_const": float(mse_const), "value_mse_const_action": float(mse_const_a),
               "value_r2": float(1 - s["v_se"] / n / mse_const.clamp(min=1e-30)),
               "risk_mse": float(s["r_se"] / n), "risk_mse_const": float(s["e_sq"] / n - (s["e_sum"] / n) ** 2),
               "top1_agree": float(s["top1"] / states), "regret": float(s["regret"] / states),
               "oracle_best_dl": float(s["best_dl"] / states)}
        return out


OBJECTIVES = {"backbone": BackboneObjective, "workspace": WorkspaceObjective, "controller": ControllerObjective}
