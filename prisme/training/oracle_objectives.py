"""The objectives that regress on the oracle (SPEC §5, stage 3; the router stage): the true drop of a position's
next-token loss for every candidate action, read by executing each candidate (only training does).

`ControllerObjective`: backbone and workspace frozen. At sampled positions, for each step of a behaviour rollout,
every candidate action is executed (the oracle) to get dL_a = CE(S) - CE(apply(S, a)) `[.., A]`; `value` is regressed
on dL (clipped at `value_clip` x scale, Huber on dL / scale: the targets are heavy-tailed) and `risk` on
|value - dL|. `RouterObjective`: the router's value head on step 0's dL, the same way.

Notation: b rows of one micro-batch on one rank, T seq_len, P oracle positions per sequence, A actions. The
objective contract (sample / denominators / forward / summarise) is `prisme.training.objectives`'.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.data.text import IGNORE_INDEX
from prisme.model.oracle import candidate_losses, repeat_queries, token_ce
from prisme.training.objectives import StageSettings


class ControllerObjective(nn.Module):
    """Stage 3: regress the controller's value on the oracle's true loss drops and its risk on the error."""

    def __init__(self, model: nn.Module, scfg: StageSettings):
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
                       on_state: Callable[..., None], n_steps: int | None = None) -> None:
        """Walk a behaviour rollout at the sampled positions; at every state execute all A candidate actions.

        Calls `on_state(r, ctx, S, edits, taken, budget, dL, valid)` with dL `[b, P, A]` the true drop of the
        position's next-token CE for each action (0 at positions without a label with `unlabelled_value="zero"`,
        where every sampled position is then valid), then moves on by the oracle's best action (with probability
        `oracle_greedy`) or a random one. `n_steps`: stop after that many states (default: the budget).
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
            loss_cur = token_ce(model.output(Hq, ctx.copy), yq, float32=True)  # [b, P]: nothing edited yet
            S = ctx.S0
            edits = torch.zeros(b, P, M, dtype=torch.long, device=x.device)
            taken = torch.zeros(b, P, A, dtype=torch.bool, device=x.device)
            budget = torch.full((b, P), b_budget, dtype=torch.long, device=x.device)
        # with unlabelled_value="zero", candidates run at labelled positions only: elsewhere dL = 0 is known, and the
        # behaviour rollout there applies just its chosen action
        zero = self.unlabelled_zero and not bool(valid.all())
        cand = torch.where(rep(valid), cand, cfg.stop_action) if zero else cand  # STOP: the editor skips them
        for r in range(b_budget if n_steps is None else min(n_steps, b_budget)):
            with torch.no_grad():
                S_c, _, loss_c = candidate_losses(model, S, ctx_a, cand, (r, b_budget - r - 1), yq,
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


class RouterObjective(ControllerObjective):
    """The router stage: the router's value head regressed on the oracle's true loss drops dL `[.., A]` of every
    action at step 0 (Huber on dL / scale, clipped as the controller's), at the sampled positions of each sequence.
    Each position's workspace runs with the deployed budget's `remaining` (`max_budget`, default 1). Only training
    executes the candidate edits; the deployed router reads no target."""

    def __init__(self, model: nn.Module, scfg: StageSettings):
        super().__init__(model, scfg)
        self.deployed_budget = scfg.max_budget or 1

    def sample(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
        out = super().sample(x, y, g)
        out["budget"] = torch.full_like(out["budget"], self.deployed_budget)  # [B]: one decision, at step 0
        return out

    def denominators(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, float]:
        _, valid = self.positions(y, extra["scores"])
        n = valid.numel() if self.unlabelled_zero else int(valid.sum())
        return {"targets": max(1, n * self.cfg.n_actions)}

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor], init_heads: bool) -> float:
        """`scale` = the std of step 0's dL on one batch; with `init_heads` (a fresh router) the head starts at the
        per-action mean target, its weights shrunk so that its input-dependent part is a tenth of the scale."""
        head = self.model.router.head
        dls: list[torch.Tensor] = []
        preds: list[torch.Tensor] = []

        def on_state(r, ctx, S, edits, taken, budget, dL, valid):
            dls.append(dL[valid].double())  # [n, A]
            preds.append((self.model.router_values(ctx) - head.bias)[valid].double())

        self.oracle_rollout(x, y, extra, on_state, n_steps=1)
        d = torch.cat(dls)
        std = float(d.std()) if d.numel() > 1 else 0.0
        self.scale = std if std > 0 and math.isfinite(std) else 1.0
        if init_heads and d.shape[0] > 0:
            t = d.clamp(-self.clip * self.scale, self.clip * self.scale)
            v0 = torch.cat(preds)
            c = min(1.0, 0.1 * self.scale / max(float(v0.std()), 1e-30))
            head.weight.mul_(c)
            head.bias.copy_((t - c * v0).mean(0).to(head.bias))
        return self.scale

    def forward(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, torch.Tensor],
                denom: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sc = self.scale
        out: dict[str, torch.Tensor] = {}

        def on_state(r, ctx, S, edits, taken, budget, dL, valid):
            v = self.model.router_values(ctx).float()  # [b, P, A]
            t = dL.float().clamp(-self.clip * sc, self.clip * sc)  # [b, P, A]
            m = valid.unsqueeze(-1).float().expand_as(t)
            out["loss"] = (F.huber_loss(v / sc, t / sc, reduction="none", delta=1.0) * m).sum()
            with torch.no_grad():
                vm = valid.float()
                best, pick = dL.argmax(-1, keepdim=True), v.argmax(-1, keepdim=True)  # [b, P, 1]
                gain = dL.gather(-1, best).squeeze(-1).float()  # the best action's drop [b, P]
                out.update(v_se=((v - t) ** 2 * m).sum(), t_sum_a=(t * m).sum((0, 1)),
                           t_sq_a=(t * t * m).sum((0, 1)), n_a=m.sum((0, 1)),
                           top1=((best == pick).squeeze(-1).float() * vm).sum(),
                           regret=((gain - dL.gather(-1, pick).squeeze(-1).float()) * vm).sum(),
                           best_dl=(gain * vm).sum(), states=vm.sum())

        self.oracle_rollout(x, y, extra, on_state, n_steps=1)
        return out.pop("loss") / denom["targets"], out

    @staticmethod
    def summarise(s: dict[str, torch.Tensor]) -> dict[str, float]:
        n = s["n_a"].sum().clamp(min=1)
        mse_const_a = ((s["t_sq_a"] - s["t_sum_a"] ** 2 / s["n_a"].clamp(min=1)).sum()) / n  # best constant / action
        states = s["states"].clamp(min=1)
        return {"loss": float(s["v_se"] / n), "value_mse": float(s["v_se"] / n),
                "value_mse_const_action": float(mse_const_a),
                "value_r2_vs_action_constant": float(1 - s["v_se"] / n / mse_const_a.clamp(min=1e-30)),
                "top1_agree": float(s["top1"] / states), "regret": float(s["regret"] / states),
                "oracle_best_dl": float(s["best_dl"] / states)}
