"""PrismeModel: backbone + causal source bank + ephemeral workspace + sparse editor + controller + readout.

Wiring only; each component lives in its own module. Notation: B batch, T (Tq queries, Tb bank) positions,
d backbone width, w workspace width, M slots, A actions, R forced steps.

Contracts (each is a test in tests/test_contracts.py):
  * explicit bypass: `actions=None`, zero-length actions or `max_budget == 0` return the backbone head (with its
    copy head, `cfg.copy_head`) without touching the workspace; positions that never edit get logits bit-identical
    to `output(H)`, `backbone.head(H)` without a copy head;
  * causality: the bank visible to position t is 0..t; nothing from t+1 onward reaches its workspace, its
    controller decisions or its logits;
  * locality: an action writes only its own slots (bitwise identity elsewhere);
  * read-only inputs: the editor never modifies H, K, V, z or S0;
  * target-free controller: it scores actions from target-free features and never executes candidate edits.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partialmethod

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import PrismeConfig, source_layer
from prisme.model.backbone import Backbone
from prisme.model.bank import SourceBank, decoded_query
from prisme.model.controller import ValueController
from prisme.model.copy import CopyHead, CopyInputs, copy_inputs
from prisme.model.editor import EditInfo, EditorRun, SlotKV, SparseEditor
from prisme.model.groups import ParameterGroups
from prisme.model.outputs import EncodedContext, PrismeOutput, Rollout, Streams
from prisme.model.plans import editor_run
from prisme.model.policy import Controller, Forced, Price, StepPolicy, check_policy
from prisme.model.readout import DifferentialReadout
from prisme.model.rollout import rollout
from prisme.model.router import Router, router_features
from prisme.model.state import DecodeState
from prisme.model.workspace import bank_mask, init_workspace, slot_counts
from prisme.options import EAGER, DecodeOptions, ExecutionOptions


class PrismeModel(ParameterGroups, nn.Module):
    """The model of `cfg`. Runtime choices ride along, apart from the architecture: `decode_options`, how a decode
    state keeps the bank unless it is given its own (`new_decode_state`), `default_price`, what a controller given
    no price runs at (0.0 each), and `execution`, how the editor runs (`set_execution`: its slot K/V cache,
    compiling); a checkpoint whose config still set them gives them to the model it loads."""

    def __init__(self, cfg: PrismeConfig, decode_options: DecodeOptions | None = None,
                 default_price: Price | None = None, execution: ExecutionOptions | None = None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        for name, v, kind in (("decode_options", decode_options, DecodeOptions),
                              ("default_price", default_price, Price), ("execution", execution, ExecutionOptions)):
            if v is not None and not isinstance(v, kind):
                raise ValueError(f"{name} must be a {kind.__module__}.{kind.__name__} or None, got {type(v).__name__}")
        self.decode_options = (DecodeOptions() if decode_options is None else decode_options).check(cfg)
        self.default_price = Price() if default_price is None else default_price
        self.backbone = Backbone(cfg)
        if cfg.use_workspace:
            from prisme.costs.analytic import action_cost_proxy

            for name, module in SourceBank.build(cfg).items():  # registered here: checkpoint keys as ever
                self.add_module(name, module)
            self.bank = SourceBank(cfg, self._modules, self.backbone._modules)  # reads them from the registry
            if cfg.controller_terms:  # the controller's own input projection (trained with the controller)
                self.P_ctrl = nn.Linear(cfg.d_model, cfg.w, bias=False)
            layers = {source_layer(t, cfg.n_layer) for t in cfg.bank_terms + cfg.query_terms + cfg.controller_terms}
            self.source_layers = tuple(sorted(layers - {cfg.n_layer}))
            seed_slots = cfg.ws_init == "seed" and cfg.z_norm
            self.slot_embed = nn.Parameter(torch.randn(cfg.n_slots, cfg.w) * (1.0 if seed_slots else cfg.init_std))
            self.editor = SparseEditor(cfg)
            self.readout = DifferentialReadout(cfg)
            self.controller = ValueController(cfg)
            projections = [*self.bank.projections(), *([self.P_ctrl] if cfg.controller_terms else [])]
            for module in (*projections, self.editor, self.readout, self.controller):
                for name, p in module.named_parameters():
                    if p.dim() >= 2 and not name.startswith("U."):
                        nn.init.normal_(p, std=self._init_std(module, name, p))
            for block in self.editor.blocks:
                nn.init.constant_(block.gate.bias, cfg.gate_bias_init)
            self.register_buffer("action_slot_counts", self._slot_counts(cfg), persistent=False)  # [A+2, M]
            self.register_buffer("action_cost", torch.tensor(action_cost_proxy(cfg)), persistent=False)  # [A]
            if cfg.router:  # built last: every other weight is drawn as without it
                self.router = Router(cfg)
        if cfg.copy_head:  # after everything else: every other weight is drawn as without it
            self.copy = CopyHead(cfg)
        self.set_execution(EAGER if execution is None else execution)

    def set_execution(self, execution: ExecutionOptions) -> bool:
        """Run the editor as `execution` (`prisme.options.ExecutionOptions`) says unless a call says otherwise (a
        decode state has options of its own: `new_decode_state(..., execution=...)`): with or without its slot K/V
        cache, eager or compiled (`prisme.model.plans.editor_run`: a `CompiledEditor`, one per distinct options,
        kept; where torch.compile cannot work, one warning and the eager editor, or a ValueError for
        compile="strict"). Returns whether the editor now runs compiled."""
        if not isinstance(execution, ExecutionOptions):
            raise ValueError(f"execution must be a prisme.options.ExecutionOptions, got {type(execution).__name__}")
        if execution.compile != "off" and not self.cfg.use_workspace:
            raise ValueError("compiling the editor needs a model with a workspace (use_workspace=True)")
        self.execution = execution
        if not self.cfg.use_workspace:
            return False
        self.editor.run = editor_run(self, execution)
        return self.editor.run.is_compiled

    def _init_std(self, module: nn.Module, name: str, p: nn.Parameter) -> float:
        """"seed": every matrix at init_std. "fan_in": the bank, editor and readout projections at 1/sqrt(fan_in),
        so that with unit-scale slots (z_norm) an edit moves a slot by O(1) from the first step instead of ~3% (the
        readout's U stays zero, so an untrained workspace still changes nothing); the controller, the gates and the
        step/remaining tables keep init_std."""
        cfg = self.cfg
        projection = name.endswith("weight") and not name.endswith(("gate.weight", "_emb.weight"))
        if cfg.ws_init == "seed" or module is self.controller or not projection:
            return cfg.init_std
        return p.shape[1] ** -0.5

    _slot_counts = staticmethod(slot_counts)

    def _apply(self, fn, *args, **kwargs):  # derived tables stay valid after casts, moves and `to_empty`
        from prisme.costs.analytic import action_cost_proxy

        out = super()._apply(fn, *args, **kwargs)
        if self.cfg.use_workspace:
            cost, counts = self.action_cost, self.action_slot_counts
            self.action_cost = torch.tensor(action_cost_proxy(self.cfg), dtype=cost.dtype, device=cost.device)
            self.action_slot_counts = self._slot_counts(self.cfg).to(counts.device)
        return out

    # ------------------------------------------------------------------ parameter groups (`ParameterGroups`)
    GROUPS = ("backbone", "workspace", "controller", "router", "copy")
    GROUP_OF = {"backbone": "backbone", "controller": "controller", "P_ctrl": "controller", "router": "router",
                "copy": "copy",
                **dict.fromkeys((*SourceBank.names(), "slot_embed", "editor", "readout"), "workspace")}
    """The group of every top-level module or parameter the model registers under any config: the controller's own
    input projection P_ctrl trains with the controller; the source bank, slots, editor and readout are the
    workspace's."""
    backbone_parameters = partialmethod(ParameterGroups.parameter_group, "backbone")
    workspace_parameters = partialmethod(ParameterGroups.parameter_group, "workspace")
    controller_parameters = partialmethod(ParameterGroups.parameter_group, "controller")
    router_parameters = partialmethod(ParameterGroups.parameter_group, "router")
    copy_parameters = partialmethod(ParameterGroups.parameter_group, "copy")

    # ------------------------------------------------------------------ the output: the head and its copy head
    def copy_inputs(self, ids: torch.Tensor | None, pos: torch.Tensor | None = None) -> CopyInputs | None:
        """What the copy head reads of the context `ids` `[B, T]` for queries at `pos` `[B, Tq]` (default: every
        position), or None for a model without one (`cfg.copy_head`)."""
        if not self.cfg.copy_head:
            return None
        if ids is None:
            raise ValueError("this model's copy head reads the token ids: pass model.streams(tokens), not a tensor")
        return copy_inputs(ids, pos)

    def output(self, H: torch.Tensor, copy_in: CopyInputs | None,
               head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The model's logits `[B, Tq, V]` of the final stream H `[B, Tq, d]`: `backbone.head(H)` (or `head(H)`), mixed
        with the copy head's distribution where it has a candidate (`cfg.copy_head`, `copy_in`: its inputs for these
        queries); without a copy head, `backbone.head(H)` bitwise."""
        logits = (self.backbone.head if head is None else head)(H)
        if copy_in is None:
            return logits
        return self.copy.mix(logits, copy_in, H)[0]

    # ------------------------------------------------------------------ encoding
    def streams(self, tokens: torch.Tensor, cache: object | None = None, n_new: list[int] | None = None) -> Streams:
        """A backbone pass (`Backbone.forward` arguments) that also keeps the source streams the workspace reads."""
        H, kept = self.backbone.streams(tokens, cache, n_new, getattr(self, "source_layers", ()))
        if not self.cfg.use_workspace:
            return Streams(H, {}, tokens)
        L = self.cfg.n_layer
        terms = dict.fromkeys(self.cfg.bank_terms + self.cfg.query_terms + self.cfg.controller_terms)
        return Streams(H, {t: H if source_layer(t, L) == L else kept[source_layer(t, L)] for t in terms}, tokens)

    def query_state(self, st: Streams | torch.Tensor, decode: DecodeOptions | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """z `[B, Tq, w]` and S0 `[B, Tq, M, w]` of query positions (`Streams`, or H for the seed's sources);
        `decode`: the options of the decode state whose queries these are (`st.ids` set; an embedding term served
        from its table where they say so), None: the bank's own projections."""
        z = self.bank.query(st) if decode is None else decoded_query(self.bank, decode, st)
        return z, init_workspace(self._parameters["slot_embed"], z)

    def encode(self, tokens: torch.Tensor) -> EncodedContext:
        """Teacher-forced parallel encoding of all positions; the bank mask is causal (key j <= query t)."""
        st = self.streams(tokens)
        return self.context_from_H(st, st)

    def context_from_H(self, H_bank: Streams | torch.Tensor, H_query: Streams | torch.Tensor,
                       query_pos: torch.Tensor | None = None, bank_len: torch.Tensor | None = None) -> EncodedContext:
        """Args:
            H_bank: `[B, Tb, d]` history, including the query positions (`Streams`, or H for the seed's sources).
            H_query: `[B, Tq, d]` (`Streams`, or H).
            query_pos: `[B, Tq]` absolute positions of the queries inside the bank (default 0..Tq-1).
            bank_len: `[B]` valid bank length per row (padded batches).
        """
        bank, query = self.bank.as_streams(H_bank), self.bank.as_streams(H_query)
        B, Tb, _ = bank.H.shape
        Tq = query.H.shape[1]
        K, V = self.bank.entries(bank)
        mask = self.bank_mask(B, Tq, Tb, query_pos, bank_len, bank.H.device)
        pos = torch.arange(Tq, device=bank.H.device).expand(B, Tq) if query_pos is None else query_pos
        ctx = self.context(query, K, V, mask, self.query_state(query), self.router_inputs(bank.ids, pos))
        ctx.copy = self.copy_inputs(bank.ids, None if query_pos is None and Tq == Tb else pos)
        return ctx

    def context(self, query: Streams, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor],
                router_in: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> EncodedContext:
        """The workspace's inputs for queries `query` (H `[B, Tq, d]` and its source streams) reading the bank K, V
        `[B, Tb, w]` under `mask` `[B, Tq, Tb]`: every `EncodedContext` is built here (teacher forcing, evaluation,
        every decode path). state: their (z, S0) (`query_state`); router_in: the router's features of the queries
        (`router_inputs`)."""
        z, S0 = state
        return EncodedContext(H=query.H, K=K, V=V, z=z, bank_mask=mask, S0=S0, ctrl_in=self.controller_stream(query),
                              router_seen=router_in[0], router_tok=router_in[1])

    def router_inputs(self, ids: torch.Tensor | None, pos: torch.Tensor | int, seen: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(`router_seen`, `router_tok`) of queries at positions `pos` in the context `ids` (`seen`: the n-gram cue
        already known, e.g. from a decode state's table)."""
        return router_features(self.cfg, ids, pos, seen)

    def router_values(self, ctx: EncodedContext) -> torch.Tensor:
        """The router's predicted loss drop of each action at step 0, `[B, Tq, A]`."""
        return self.router(ctx.H, ctx.router_seen, ctx.router_tok)

    def controller_stream(self, st: Streams | torch.Tensor) -> torch.Tensor | None:
        """The normed stream `[B, Tq, d]` the controller projects (`cfg.controller_source`), or None (it reads z)."""
        if not self.cfg.controller_terms:
            return None
        X = self.bank.as_streams(st).src[self.cfg.controller_terms[0]]
        return F.rms_norm(X, (X.shape[-1],), eps=self.cfg.norm_eps)

    def controller_z(self, ctx: EncodedContext) -> torch.Tensor:
        """The controller's first feature `[B, Tq, w]`: z, or its own projection of `cfg.controller_source`."""
        if ctx.ctrl_in is None:
            return ctx.z
        return F.rms_norm(self.P_ctrl(ctx.ctrl_in), (self.cfg.w,), eps=self.cfg.norm_eps)

    def controller_inputs(self, ctx: EncodedContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the controller reads of each position once, before its loop: z_c `[B, Tq, w]` and its position features
        `[B, Tq, n_position_features]` (the bank match with `cfg.controller_bank`, the backbone's entropy with
        `cfg.controller_entropy`; None without either)."""
        zc = self.controller_z(ctx)
        feats = []
        if self.cfg.controller_bank:
            feats.append(self.controller.bank_match(zc, ctx.K, ctx.bank_mask))  # [B, Tq, 2]
        if self.cfg.controller_entropy:
            feats.append(self.controller.entropy(ctx.H, self.backbone.head))  # [B, Tq, 1]
        return zc, torch.cat(feats, -1) if feats else None

    bank_mask = staticmethod(bank_mask)  # `prisme.model.workspace.bank_mask`

    # ------------------------------------------------------------------ one action, readout
    def new_slot_kv(self, S0: torch.Tensor, run: EditorRun | None = None) -> SlotKV | None:
        """The editor's slot K/V cache for a fresh workspace (None unless its run keeps one: `EditorRun.slot_kv`;
        `run` None: the editor's own)."""
        return SlotKV.empty(S0, self.cfg.n_edit_blocks) if (run or self.editor.run).slot_kv else None

    def apply_action(self, S: torch.Tensor, ctx: EncodedContext, action: torch.Tensor, step: int | torch.Tensor,
                     remaining: int | torch.Tensor, slot_kv: SlotKV | None = None, run: EditorRun | None = None
                     ) -> tuple[torch.Tensor, EditInfo]:
        """Edit the slots of `action` `[B, Tq]` at every position; returns (S_new, info). S is not modified."""
        B, Tq = action.shape
        if not torch.is_tensor(step):
            step = torch.full((B, Tq), int(step), device=S.device, dtype=torch.long)
        if not torch.is_tensor(remaining):
            remaining = torch.full((B, Tq), int(remaining), device=S.device, dtype=torch.long)
        return self.editor(S, ctx, action, step, remaining, slot_kv, run)

    def logits_from_state(self, S: torch.Tensor, ctx: EncodedContext, edited: torch.Tensor | None = None,
                          head: Callable[[torch.Tensor], torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits = output(H + U(r(S) - r(S0))) at edited positions `[B, Tq]` (None: at every one) and output(H)
        elsewhere (bitwise; `output`: the head, and the copy head where the model has one).

        The readout runs only on edited positions. `head` replaces `backbone.head` (training uses it to keep the
        workspace's loss out of the head's weights). Returns (logits `[B, Tq, V]`, delta `[B, Tq, d]`).
        """
        if edited is None:  # every position edited (a routed decode step's fired rows): no gather, no scatter
            d = self.readout(S.flatten(0, 1), ctx.S0.flatten(0, 1), ctx.z.flatten(0, 1)).to(ctx.H.dtype)  # [B Tq, d]
            delta = d.view(ctx.H.shape)
            return self.output(ctx.H + delta, ctx.copy, head), delta
        b, t = torch.nonzero(edited, as_tuple=True)
        delta = ctx.H.new_zeros(ctx.H.shape)
        if b.numel() == 0:
            return self.output(ctx.H, ctx.copy, head), delta
        d = self.readout(S[b, t], ctx.S0[b, t], ctx.z[b, t])  # [N, d]
        delta = delta.index_put((b, t), d.to(delta.dtype))
        H = ctx.H.index_put((b, t), (ctx.H[b, t] + d).to(ctx.H.dtype))
        return self.output(H, ctx.copy, head), delta

    # ------------------------------------------------------------------ rollouts (shared with decoding)
    # ------------------------------------------------------------------ forward passes
    def forward(self, tokens: torch.Tensor, actions: torch.Tensor | None = None,
                budget: int | torch.Tensor | None = None, return_state: bool = False,
                ctx: EncodedContext | None = None) -> PrismeOutput:
        """Forced-action forward (training, fixed policies, tests).

        Args:
            tokens: `[B, T]` ids.
            actions: `[B, T, R]` ids in [0, A+1] (STOP = A pads unused steps, absorbing; DENSE = A+1), R <= r_max;
                None or R == 0 -> exact bypass (the backbone alone).
            budget: each position's budget (int or `[B, T]`, in [1, r_max], default R); the editor's
                `remaining = budget - step - 1`. Non-STOP actions at steps >= budget are an error.
            ctx: `encode(tokens)` when several calls share one batch (evaluation).
        """
        cfg = self.cfg
        if actions is not None and not isinstance(actions, torch.Tensor):
            raise ValueError(f"actions must be a [B, T, R] tensor of action ids (or None), got "
                             f"{type(actions).__name__}")
        if actions is None or not cfg.use_workspace or actions.shape[-1] == 0:
            if actions is not None and not cfg.use_workspace and actions.shape[-1] > 0:
                raise ValueError("this model has no workspace (use_workspace=False): actions must be None")
            H = self.backbone(tokens)
            return PrismeOutput(logits=self.output(H, self.copy_inputs(tokens)), H=H)
        ws = check_policy(self, Forced(actions, budget), tokens=tokens)  # ids, R <= r_max, budgets in [1, r_max]
        ctx = self.encode(tokens) if ctx is None else ctx
        return self._output(ctx, ws, return_state)

    @torch.no_grad()
    def forward_policy(self, tokens: torch.Tensor, max_budget: int | None = None, cost: torch.Tensor | None = None,
                       lambda_cost: float | None = None, kappa_risk: float | None = None,
                       return_state: bool = False, ctx: EncodedContext | None = None,
                       policy: Controller | None = None) -> PrismeOutput:
        """Teacher-forced parallel rollout of the deployed policy at every position (evaluation only); returns logits
        and the action trace `[B, T, max_budget]`.

        Args:
            policy: the `prisme.model.policy.Controller` to run; or, in the seed's call form, its fields: `max_budget`,
                `cost` `[A]` the price per action (default: the cost model's proxy at `cfg.cost_context`),
                `lambda_cost` and `kappa_risk` (default: the model's price). Either is checked once
                (`check_policy`).
            ctx: as in `forward`.
        """
        if policy is None:
            policy = Controller(max_budget, lambda_cost, kappa_risk, cost)
        elif not isinstance(policy, Controller) or (max_budget, cost, lambda_cost, kappa_risk) != (None,) * 4:
            raise ValueError("forward_policy: give a Controller as policy=, or its fields (max_budget, cost, "
                             "lambda_cost, kappa_risk), not both")
        ws = check_policy(self, policy)
        if ws.n_steps == 0:
            H = self.backbone(tokens)
            zeros = torch.zeros(tokens.shape, dtype=torch.long, device=tokens.device)
            return PrismeOutput(logits=self.output(H, self.copy_inputs(tokens)), H=H, n_edits=zeros,
                                controller_steps=zeros, actions=zeros.unsqueeze(-1)[..., :0])
        ctx = self.encode(tokens) if ctx is None else ctx
        return self._output(ctx, ws, return_state)

    def run_workspace(self, ctx: EncodedContext, policy: StepPolicy, valid: torch.Tensor | None = None,
                      run: EditorRun | None = None) -> tuple[torch.Tensor, torch.Tensor, Rollout]:
        """The workspace pipeline: the queries of `ctx` (built by `context`) run `policy` (forced actions, or the
        controller with the router at step 0 on a router model: `prisme.model.rollout`) and read out. `forward`,
        `forward_policy`, evaluation and the decode plans "general" and "static" all run this; the plans "routed" and
        "budget1" (`prisme.model.plans`) compute the same at the positions where the router fired.

        Args:
            policy: the checked policy (`prisme.model.policy.check_policy`).
            valid: `[B, Tq]` the real queries (None: all are); the others' traces, edits and controller steps are
                dropped (STOP, 0), and they read out as not edited.
            run: how the editor runs (None: its own; a decode plan passes its state's).
        Returns:
            (logits `[B, Tq, V]`, the readout's correction `[B, Tq, d]`, the rollout).
        """
        roll = rollout(self, ctx, policy, run)
        if valid is not None:  # padding queries ran along (per-position independent); their results are dropped
            roll = Rollout(roll.S, roll.actions.masked_fill(~valid.unsqueeze(-1), self.cfg.stop_action),
                           roll.n_edits.masked_fill(~valid, 0), roll.controller_steps.masked_fill(~valid, 0),
                           roll.infos)
        logits, delta = self.logits_from_state(roll.S, ctx, roll.n_edits > 0)
        return logits, delta, roll

    def _output(self, ctx: EncodedContext, policy: StepPolicy, return_state: bool) -> PrismeOutput:
        """The workspace's logits at every position of `ctx` under `policy` (the readout at edited positions, the
        backbone's elsewhere) and its trace."""
        logits, delta, roll = self.run_workspace(ctx, policy)
        out = PrismeOutput(logits=logits, H=ctx.H, n_edits=roll.n_edits, delta=delta, actions=roll.actions,
                           controller_steps=roll.controller_steps)
        if return_state:
            out.ctx, out.S_final, out.infos = ctx, roll.S, roll.infos
        return out

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts per group."""
        out = {k: sum(p.numel() for p in v) for k, v in self.parameter_groups()}
        if not self.cfg.router:
            del out["router"]
        if not self.cfg.copy_head:
            del out["copy"]
        return out

    def new_decode_state(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                         bank: bool | None = None, options: DecodeOptions | None = None,
                         execution: ExecutionOptions | None = None) -> DecodeState:
        """Allocate a `prisme.model.state.DecodeState` (backbone KV cache, source bank, per-row lengths); `options`:
        how it keeps the bank (`prisme.options.DecodeOptions`; None: `self.decode_options`), `execution`: how its
        editor runs (`prisme.options.ExecutionOptions`; None: `self.execution`), so one model decodes either way."""
        return DecodeState(self, batch_size, max_len, dtype, bank, options, execution)


def decode_state_bytes(cfg: PrismeConfig, batch_size: int, max_len: int, options: DecodeOptions | None = None) -> int:
    """The bytes of a float32 decode state of `cfg`'s model at capacity `max_len` and `batch_size` rows, without
    building that model or state: every buffer is a constant or grows linearly with the capacity and the rows, so two
    small states (one row, capacities t0 and 2 t0 - 1, t0 past the attention window) give the line exactly."""
    t0 = 2 * (cfg.attn_window or 0) + 2
    per_row = [PrismeModel(cfg.replace(max_seq_len=t, cost_context=t), options)
               .new_decode_state(1).nbytes for t in (t0, 2 * t0 - 1)]
    slope = (per_row[1] - per_row[0]) / (t0 - 1)
    return batch_size * round(per_row[0] + slope * (max_len - t0))
