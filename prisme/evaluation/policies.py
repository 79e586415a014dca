"""The policies an evaluation compares (SPEC §5), one small class per family: each plans its rows, runs a row on the
batch's shared encoding (`prisme.evaluation.batch.Batch`) and returns what it predicted and the trace it paid for.

Families (a row's `family`): the backbone alone (`BackboneRows`), other backbones scored on the same targets
(`ReferenceRows`: the matched backbone, "backbone+matched", and the frontier's models), fixed / random / dense action
plans (`FixedRows`, `RandomRows`, `DenseRows`), the deployed policy at each price (`ControllerRows`, running a
`prisme.model.policy.Controller`) with its equal-edits baseline (`EqualEditsRows`), and the greedy oracle
(`OracleRows`, not deployable: it reads the targets). `standard_policies` builds
them from family names (the CLI's and the studies' vocabulary); `ROW_KINDS` is what a report needs to know of a
family (marker, whether it runs the workspace, which of its differences is to itself).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from prisme.checks import is_int
from prisme.config import PrismeConfig, untrained_for_policy
from prisme.evaluation.actions import default_lambdas, sample_positions, thinned_actions
from prisme.evaluation.batch import Batch, Outcome
from prisme.evaluation.far_reads import ExactCopy
from prisme.evaluation.oracle import greedy_oracle
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel

BUDGETS = (1, 2, 4, 8)
__all__ = ["ROW_KINDS", "row_family_of_name", "Row", "Policy", "BackboneRows", "ReferenceRows", "FixedRows",
           "RandomRows", "DenseRows", "ControllerRows", "EqualEditsRows", "ExactCopyRows", "OracleRows",
           "forced_actions", "thinned_actions", "sample_positions", "default_lambdas"]


# ---------------------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class RowKind:
    """What a report needs to know of a family's rows."""

    family: str
    marker: str  # matplotlib marker and colour of its points
    color: str
    workspace: bool = False  # its rows run the workspace
    backbone_only: bool = False  # a backbone alone (may make the dense frontier)
    own_reference: str | None = None  # the paired difference that is this row against itself (not a verdict)
    sampled: bool = False  # scored on sampled positions only (compared there)
    baseline: bool = False  # a baseline of another row (the controller's equal-edits row)
    names: str = ""  # the form of its rows' names (a regular expression); "": any name (a reference's own)


ROW_KINDS: dict[str, RowKind] = {}  # every family's kind, registered by the Policy class that makes its rows


def row_family_of_name(name: str) -> str | None:
    """The family whose rows take names of the form of `name` (`RowKind.names`), or None: a name another row may
    take (a reference's) without meeting a policy row's, whatever prices and budgets the evaluation plans."""
    return next((k.family for k in ROW_KINDS.values() if k.names and re.fullmatch(k.names, name)), None)


@dataclass(frozen=True)
class Row:
    """One planned row of an evaluation: a policy at one setting."""

    name: str
    policy: Policy
    n: int = 0  # actions (forced) or max budget (controller / oracle)
    k: int = 0  # 1 (slots), 2 (pairs), M (dense)
    lam: float | None = None
    of: str | None = None  # equal_edits: the controller row whose mean edits it matches

    @property
    def family(self) -> str:
        return self.policy.family

    @property
    def kind(self) -> RowKind:
        return ROW_KINDS[self.policy.family]


def _fmt_lambda(lam: float) -> str:
    return "0" if lam == 0 else f"{lam:.3g}"


# ---------------------------------------------------------------------------------------------------------- policies
class Policy:
    """A family of rows. Subclasses set `family` and implement `plan` and `run`."""

    kinds: tuple[RowKind, ...] = ()  # the row kinds this class makes (registered in ROW_KINDS); family: the first
    family = ""
    needs_workspace = False
    shares_encoding = False  # runs on the batch's shared encoding (and is charged its time)
    planned: tuple[Row, ...] = ()  # the rows of its last `plan`

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kinds" in cls.__dict__:
            for kind in cls.kinds:
                if ROW_KINDS.get(kind.family, kind) != kind:
                    raise ValueError(f"policy family {kind.family!r} is declared twice")
                ROW_KINDS[kind.family] = kind
            cls.family = cls.kinds[0].family

    def plan(self, model: PrismeModel, first_tokens: torch.Tensor) -> list[Row]:
        """The rows of this family (first_tokens `[B, T]`: the first batch, for data-driven defaults)."""
        raise NotImplementedError

    def run(self, row: Row, batch: Batch) -> Outcome:
        raise NotImplementedError

    def check(self, model: PrismeModel, seq_len: int) -> None:
        """ValueError if this policy cannot run on `model` at `seq_len`."""
        if self.needs_workspace and not model.cfg.use_workspace:
            raise ValueError(f"this model has no workspace (use_workspace=False): policy {self.family!r} needs one")

    def priced_by(self, model: PrismeModel) -> PrismeConfig:
        """The config whose cost model prices this policy's trace."""
        return model.cfg

    def untrained(self, row: Row, cfg: PrismeConfig, groups: set[str]) -> list[str]:
        """The parts this row runs that no stage trained (`groups`: the checkpoint's trained groups)."""
        return ["workspace"] if self.needs_workspace and row.n and "workspace" not in groups else []

    def models(self) -> list[PrismeModel]:
        """Other models this policy runs (put in eval mode for the evaluation)."""
        return []


class BackboneRows(Policy):
    """The backbone alone: the exact bypass, from the batch's shared encoding."""

    kinds = (RowKind("backbone", "s", "C0", backbone_only=True, own_reference="delta_vs_backbone",
                     names="backbone"),)
    shares_encoding = True

    def plan(self, model, first_tokens):
        return [Row("backbone", self)]

    def run(self, row, batch):
        return Outcome(batch.base_logits)


class ReferenceRows(Policy):
    """Another model's backbone alone, scored on the same targets (`name`: its row). With `matched=True` it is the
    "backbone + matched tokens" baseline: the evaluated backbone trained on as many extra tokens as the workspace
    stage used, and every row gets its paired difference to it (`delta_vs_matched`)."""

    kinds = (RowKind("matched", "D", "C1", backbone_only=True, own_reference="delta_vs_matched",
                     names=r"backbone\+matched"),
             RowKind("reference", "h", "C8", backbone_only=True))

    def __init__(self, name: str, model: PrismeModel, matched: bool = False):
        if not isinstance(model, PrismeModel):
            raise ValueError(f"reference {name!r} must be a PrismeModel, got {type(model).__name__}")
        self.name, self.model, self.matched = name, model, matched
        self.family = self.kinds[0 if matched else 1].family

    def plan(self, model, first_tokens):
        return [Row(self.name, self)]

    def check(self, model, seq_len):
        if self.model.cfg.vocab_size != model.cfg.vocab_size:
            what = "matched_backbone" if self.matched else f"reference {self.name!r}"
            raise ValueError(f"{what} vocab_size={self.model.cfg.vocab_size} differs from the model's "
                             f"{model.cfg.vocab_size}")
        if seq_len > self.model.cfg.max_seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds {self.name} max_seq_len={self.model.cfg.max_seq_len}")

    def logits(self, batch: Batch) -> torch.Tensor:
        """Its logits `[B, T, V]` on the batch (computed once per batch)."""
        return batch.memo(("reference", self.name), lambda: self.model(
            batch.x.to(next(self.model.parameters()).device)).logits.to(batch.x.device))

    def run(self, row, batch):
        return Outcome(self.logits(batch))

    def priced_by(self, model):
        return self.model.cfg

    def models(self):
        return [self.model]


class ForcedRows(Policy):
    """Forced action plans: n actions of k slots at every scored position (the scorer says which), no controller."""

    needs_workspace = True
    shares_encoding = True

    def __init__(self, budgets: Sequence[int] | None = None, ks: Sequence[int] = (1, 2)):
        self.budgets, self.ks = budgets, tuple(ks)

    def plan(self, model, first_tokens):
        ns = [n for n in (BUDGETS if self.budgets is None else self.budgets) if n <= model.cfg.r_max]
        return [Row(f"{self.family}_{n}xk{k}", self, n, k) for k in self.ks for n in ns]

    def actions(self, cfg: PrismeConfig, n: int, k: int, shape: tuple[int, int],
                generator: torch.Generator | None) -> torch.Tensor:
        """`[B, T, n]` action ids (CPU)."""
        raise NotImplementedError

    def run(self, row, batch):
        return batch.run_forced(row.name, lambda shape, g: self.actions(batch.model.cfg, row.n, row.k, shape, g))


class FixedRows(ForcedRows):
    """Step r edits slot r mod M (k = 1) or pair M + (r mod M/2) (k = 2) at every position."""

    kinds = (RowKind("fixed", "o", "C2", workspace=True, names=r"fixed_\d+xk\d+"),)

    def actions(self, cfg, n, k, shape, generator):
        M = cfg.n_slots
        steps = torch.arange(n)
        row = steps % M if k == 1 else M + steps % (M // 2)  # [n]
        return row.view(1, 1, n).expand(*shape, n)


class RandomRows(ForcedRows):
    """Uniform single slots (k = 1) or pairs (k = 2), drawn from the batch's common random numbers."""

    kinds = (RowKind("random", "x", "C3", workspace=True, names=r"random_\d+xk\d+"),)

    def actions(self, cfg, n, k, shape, generator):
        lo, hi = (0, cfg.n_slots) if k == 1 else (cfg.n_slots, cfg.n_actions)
        return torch.randint(lo, hi, (*shape, n), generator=generator)


class DenseRows(ForcedRows):
    """n DENSE actions (every slot attends to the bank at each step)."""

    kinds = (RowKind("dense", "^", "C4", workspace=True, names=r"dense_\d+"),)

    def __init__(self, budgets: Sequence[int] | None = None, ks: Sequence[int] = ()):
        super().__init__(budgets, ks=())  # every slot: no k to choose

    def plan(self, model, first_tokens):
        ns = [n for n in (BUDGETS if self.budgets is None else self.budgets) if n <= model.cfg.r_max]
        return [Row(f"dense_{n}", self, n, model.cfg.n_slots) for n in ns]

    def actions(self, cfg, n, k, shape, generator):
        return torch.full((*shape, n), cfg.dense_action)


FORCED = {cls.family: cls for cls in (FixedRows, RandomRows, DenseRows)}


def forced_actions(cfg: PrismeConfig, family: str, n: int, k: int, shape: tuple[int, int],
                   generator: torch.Generator | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Forced actions `[B, T, n]` of a fixed / random / dense policy (`FixedRows`, `RandomRows`, `DenseRows`)."""
    if family not in FORCED:
        raise ValueError(f"forced_actions: unknown family {family!r}; expected one of {list(FORCED)}")
    acts = FORCED[family]().actions(cfg, n, k, shape, generator)
    return acts.to(device=device, dtype=torch.long).contiguous()


def _controller_budget(model: PrismeModel, budget: int | None) -> int:
    R = model.cfg.r_max if budget is None else budget
    if not is_int(R) or not 1 <= R <= model.cfg.r_max:
        raise ValueError(f"controller_budget must be an int in [1, r_max={model.cfg.r_max}], got {R!r}")
    return R


class ControllerRows(Policy):
    """The deployed policy (`forward_policy`; with `cfg.router`, the router decides step 0) at each price, each row
    followed by its equal-edits baseline (`equal_edits=True`): the same mean edits spread uniformly."""

    kinds = (RowKind("controller", "*", "C5", workspace=True, names=r"controller\(.*\)"),)
    needs_workspace = True
    shares_encoding = True

    def __init__(self, lambdas: Sequence[float] | None = None, budget: int | None = None,
                 kappa_risk: float | None = None, equal_edits: bool = True):
        self.lambdas, self.budget, self.kappa_risk = lambdas, budget, kappa_risk
        self.baseline = EqualEditsRows() if equal_edits else None

    def plan(self, model, first_tokens):
        R = _controller_budget(model, self.budget)
        lams = self.lambdas if self.lambdas is not None else default_lambdas(model, first_tokens, budget=self.budget)
        out = []
        for lam in (float(x) for x in lams):
            name = f"controller(lambda={_fmt_lambda(lam)})"
            out.append(Row(name, self, R, 0, lam))
            if self.baseline is not None:
                out.append(Row(f"equal_edits(lambda={_fmt_lambda(lam)})", self.baseline, R, 1, lam, of=name))
        return out

    def run(self, row, batch):
        out = batch.model.forward_policy(batch.x, ctx=batch.ctx, policy=Controller(row.n, row.lam, self.kappa_risk))
        return Outcome(out.logits, actions=out.actions, steps=out.controller_steps, routed=batch.model.cfg.router,
                       mean_edits=float(out.n_edits.double().mean()))

    def untrained(self, row, cfg, groups):
        return untrained_for_policy(cfg, groups, row.n)


class RouterRows(ControllerRows):
    """A router model's deployed policy (`cfg.router`): the router decides whether a position takes its one edit
    (budget 1) at each price; each row followed by its equal-edits baseline. The rows a `prisme fit` or a long-context
    study deploys (the "controller" family at budget 1, named for what decides)."""

    kinds = (RowKind("router", "P", "C4", workspace=True, names=r"router\(.*\)"),)

    def __init__(self, lambdas: Sequence[float] | None = None, kappa_risk: float | None = None,
                 equal_edits: bool = True):
        super().__init__(lambdas, 1, kappa_risk, equal_edits)

    def plan(self, model, first_tokens):
        if not model.cfg.router:
            raise ValueError(f"policy 'router' needs a router model (cfg.router); {model.cfg.name!r} has none: "
                             f"evaluate its controller rows (--policies controller)")
        return [Row(r.name.replace("controller(", "router(", 1), r.policy, r.n, r.k, r.lam,
                    of=None if r.of is None else r.of.replace("controller(", "router(", 1))
                for r in super().plan(model, first_tokens)]


class EqualEditsRows(Policy):
    """The controller row's mean edits per position, as fixed round-robin single-slot edits thinned at random
    (seeded per batch) to that mean: the same edit count spread uniformly instead of allocated."""

    kinds = (RowKind("equal_edits", "v", "C7", workspace=True, baseline=True, names=r"equal_edits\(.*\)"),)
    needs_workspace = True
    shares_encoding = True

    def run(self, row, batch):
        g = torch.Generator().manual_seed(batch.seed + 7919 * (batch.index + 1))
        acts = thinned_actions(batch.model.cfg, batch.mean_edits[row.of], row.n, tuple(batch.x.shape), g,
                               batch.x.device)
        out = batch.model(batch.x, acts, ctx=batch.ctx)
        return Outcome(out.logits, actions=out.actions)


class ExactCopyRows(Policy):
    """The untrained exact-copy reference (`prisme.evaluation.far_reads.ExactCopy`: the byte after the most recent
    occurrence of the longest >= 4-token suffix match, one gate per match length) mixed into another model's
    distribution (`model`, e.g. PRISME's backbone without a copy head), its gates fitted by maximum likelihood on
    `fit()`'s batches (x, y) before the first row runs (validation; applied unchanged to a held-out text); `far`: read
    only matches beyond a window of that many positions (None: every earlier one). Priced as its model plus the copy
    head's lookups (`costs.analytic.copy_head_ops`, no stream)."""

    kinds = (RowKind("exact_copy", "X", "C9", names=r"exact_copy.*"),)

    def __init__(self, name: str, model: PrismeModel, fit: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
                 far: int | None = None):
        self.name, self.model, self.fit, self.read = name, model, fit, ExactCopy(far=far)
        self.fitted = False

    def plan(self, model, first_tokens):
        return [Row(self.name, self)]

    def _fit(self, device: torch.device) -> None:
        ps, bs, cs, ys = [], [], [], []
        with torch.no_grad():
            for x, y in self.fit():
                x, y = x.to(device), y.to(device)
                lp = torch.log_softmax(self.model(x).logits.double(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1))
                b, c = self.read.match(x)
                keep = y >= 0
                ps.append(lp.squeeze(-1).exp()[keep]), bs.append(b[keep]), cs.append(c[keep]), ys.append(y[keep])
        self.read.fit(torch.cat(ps), torch.cat(bs), torch.cat(cs), torch.cat(ys))
        self.fitted = True

    def run(self, row, batch):
        dev = next(self.model.parameters()).device
        if not self.fitted:
            self._fit(dev)
        x = batch.x.to(dev)
        logits = batch.memo(("reference", self.name), lambda: self.read.mix(self.model(x).logits, x))
        return Outcome(logits.to(batch.x.device))

    def priced_by(self, model):
        return self.model.cfg.replace(copy_head=True, copy_stream=0)

    def models(self):
        return [self.model]


class OracleRows(Policy):
    """The greedy oracle at each price, at `positions` labelled positions per sequence (None: all of them); its
    trace is charged as if a controller had chosen it (min(n + 1, budget) steps). With `every_position` it knows
    where the scored targets are and stops at once everywhere else: its trace covers every position (one
    controller step where it does nothing), as a deployed policy's would."""

    kinds = (RowKind("oracle", "P", "C6", workspace=True, sampled=True, names=r"oracle\(.*\)"),)
    needs_workspace = True

    def __init__(self, lambdas: Sequence[float] | None = None, positions: int | None = 16, budget: int | None = None,
                 every_position: bool = False):
        if positions is not None and (not is_int(positions) or positions < 1):
            raise ValueError(f"oracle_positions must be an int >= 1 or None (all labelled positions), got "
                             f"{positions!r}")
        self.lambdas, self.positions, self.budget, self.every_position = lambdas, positions, budget, every_position

    def plan(self, model, first_tokens):
        R = _controller_budget(model, self.budget)
        lams = self.lambdas if self.lambdas is not None else default_lambdas(model, first_tokens, budget=self.budget)
        return [Row(f"oracle(lambda={_fmt_lambda(lam)})", self, R, 0, float(lam)) for lam in lams]

    def run(self, row, batch):
        rows, pos = batch.oracle_positions(self.positions)  # the same positions for every oracle row of a batch
        if rows.numel() == 0:
            return None
        x, y = batch.x, batch.y
        res = greedy_oracle(batch.model, x[rows], y[rows], pos, row.n, row.lam)
        steps = torch.clamp(res.n_edits + 1, max=row.n)  # as if a controller had chosen the trace
        if not self.every_position:
            return Outcome(res.logits, at=(rows, pos), actions=res.actions, contexts=pos + 1, steps=steps,
                           base_ce=res.base_loss)
        B, T = x.shape
        cfg = batch.model.cfg
        full = torch.full((B, T, row.n), cfg.stop_action, device=x.device)
        full[rows.unsqueeze(1), pos] = res.actions
        n_full = torch.zeros(B, T, dtype=torch.long, device=x.device)
        n_full[rows.unsqueeze(1), pos] = res.n_edits
        return Outcome(res.logits, at=(rows, pos), actions=full, steps=torch.clamp(n_full + 1, max=row.n),
                       base_ce=res.base_loss)
