"""`prisme bench workspace`'s paths: the models, the forced rows, states that rewind exactly, and the
split timer that separates the backbone's time from the workspace's."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import torch

from prisme.config import PrismeConfig
from prisme.costs.analytic import SEED_ROWS
from prisme.evaluation.policies import forced_actions
from prisme.model.policy import Forced
from prisme.model.prisme import PrismeModel
from prisme.model.state import DecodeState
from prisme.options import ExecutionOptions

ROWS = tuple(SEED_ROWS)  # backbone_only, 4_actions_k1, 4_actions_k2, 8_actions_k2, 8_actions_dense16
VARIANTS = ("opt", "opt_kv", "seed")  # cfg.optimised True (slot K/V cache off / on) / False, same weights
COMPILED = "compiled"  # with --compile: the seed model with its editor under torch.compile (prisme.model.compiled)
PATHS = {"-": "backbone only (no source bank, no workspace)",
         "opt": "eager editor, every slot's K/V recomputed in every block; folded readout (cfg.optimised=True, the "
                "default: no slot K/V cache)",
         "opt_kv": "eager editor with the slot K/V cache, folded readout (cfg.optimised=True, "
                   "ExecutionOptions(slot_kv_cache=True))",
         "seed": "eager editor, every slot's K/V recomputed in every block (cfg.optimised=False)",
         COMPILED: "compiled editor: fixed-shape decode graphs, every row padded in, the bank at capacity; seed "
                   "accounting (cfg.optimised=False)"}


# --------------------------------------------------------------------------------------------------------------- model
def build_models(cfg: PrismeConfig, seed: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", compile: bool = False) -> dict[str, PrismeModel]:
    """The same seeded, untrained weights as `{"opt": cfg.optimised=True, "opt_kv": ... run with
    ExecutionOptions(slot_kv_cache=True),
    "seed": cfg.optimised=False}`, eval mode.

    The readout's U (zero-initialised) gets N(0, init_std) weights, so edits reach the logits. The global RNG is
    left alone.
    """
    if not cfg.use_workspace:
        raise ValueError(f"preset {cfg.name!r} has no workspace (use_workspace=False): nothing to benchmark")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        opt = PrismeModel(cfg.replace(optimised=True))
        torch.nn.init.normal_(opt.readout.U.weight, std=cfg.init_std)
        ref = PrismeModel(cfg.replace(optimised=False))
        kv = PrismeModel(cfg.replace(optimised=True), execution=ExecutionOptions(slot_kv_cache=True))
    ref.load_state_dict(opt.state_dict())
    kv.load_state_dict(opt.state_dict())
    models = {v: m.to(device=device, dtype=dtype).eval() for v, m in (("opt", opt), ("opt_kv", kv), ("seed", ref))}
    if compile:  # the seed accounting (every slot's K/V recomputed, in one graph per action group), compiled
        from prisme.model.compiled_editor import compile_editor

        comp = PrismeModel(cfg.replace(optimised=False))
        comp.load_state_dict(opt.state_dict())
        models[COMPILED] = comp.to(device=device, dtype=dtype).eval()
        compile_editor(models[COMPILED], strict=True)
    return models


def row_plan(cfg: PrismeConfig, row: str, batch: int) -> tuple[torch.Tensor | None, list[int]]:
    """Forced actions `[B, n]` of one seed-000 row (STOP after row b's n_b actions) and each row's n_b.

    Batch 1: n_b = n. Batch B > 1: n_b = ceil((b + 1) n / B), so rows stop at different steps.
    Returns (None, [0] * B) for backbone_only.
    """
    if row not in SEED_ROWS:
        raise ValueError(f"unknown row {row!r}; choose from {ROWS}")
    n, k = SEED_ROWS[row]
    if n == 0:
        return None, [0] * batch
    if n > cfg.r_max:
        raise ValueError(f"row {row!r} needs {n} actions but preset {cfg.name!r} has r_max={cfg.r_max}")
    # slots 0, 1, 2, ..., pairs (0,1), (2,3), ... repeating when M/2 < n, or n DENSE actions: the evaluation's plan
    ids = forced_actions(cfg, "dense" if row.endswith("dense16") else "fixed", n, k, (1, 1))[0, 0].tolist()
    counts = [n] * batch if batch == 1 else [math.ceil((b + 1) * n / batch) for b in range(batch)]
    acts = torch.full((batch, n), cfg.stop_action, dtype=torch.long)
    for b, n_b in enumerate(counts):
        acts[b, :n_b] = torch.tensor(ids[:n_b])
    return acts, counts


# --------------------------------------------------------------------------------------------------------- split timer
class SplitTimer:
    """Times the backbone step, the LM head and the workspace methods inside `decode_step`, without changing them.

    Installs instance-attribute wrappers on each model (removed on exit): `backbone.streams`, `backbone.head`, and the
    workspace methods `bank.inputs`, `bank.from_inputs`, `query_state`, `bank_mask`, `apply_action` (each step of
    the rollout), `logits_from_state` (the head
    called inside the readout counts as head). On CUDA each wrapper records CUDA events around its call and nothing
    waits inside the timed region: `ns` reads the events (one synchronisation, after the run). With `label`, each
    wrapped call also opens a `torch.profiler.record_function("prisme::<backbone|head|method name>")` range.

        with SplitTimer(models) as st:
            st.reset(); ...; st.ns  # {"backbone": ns, "head": ns, "workspace_modules": ns}
    """

    SECTIONS = ("backbone", "head", "workspace_modules")
    _WORKSPACE_METHODS = (("bank", "inputs"), ("bank", "from_inputs"), ("", "query_state"), ("", "bank_mask"),
                          ("", "apply_action"), ("", "logits_from_state"))  # (the model's attribute, method)

    @staticmethod
    def label_of(owner: str, name: str) -> str:
        """A wrapped method's name in the profile: `bank.inputs`, `query_state`, ..."""
        return f"{owner}.{name}" if owner else name

    def __init__(self, models: Sequence[PrismeModel], label: bool = False):
        self.models = list(models)
        self.label = label
        self._ns = dict.fromkeys(self.SECTIONS, 0)
        self._cuda = False
        self._pending: list[tuple[str, Any, Any, int, int]] = []  # CUDA: (section, start, end, heads from, to)
        self._depth = 0

    def reset(self) -> None:
        self._ns = dict.fromkeys(self.SECTIONS, 0)
        self._pending = []

    @property
    def ns(self) -> dict[str, int]:
        """Nanoseconds per section since `reset` (on CUDA: read from the recorded events, after they complete)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            heads = [i for i, p in enumerate(self._pending) if p[0] == "head"]
            elapsed = [int(p[1].elapsed_time(p[2]) * 1e6) for p in self._pending]
            for i, (section, _, _, h0, h1) in enumerate(self._pending):
                inner = sum(elapsed[j] for j in heads if h0 <= j < h1) if section == "workspace_modules" else 0
                self._ns[section] += elapsed[i] - inner
            self._pending = []
        return self._ns

    def _wrap(self, fn: Callable[..., Any], section: str, name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = torch.profiler.record_function(f"prisme::{name}") if self.label else contextlib.nullcontext()
            ws = section == "workspace_modules"
            if ws and self._depth > 0:  # nested workspace call (none today): already timed by the outer one
                return fn(*args, **kwargs)
            if self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                first = len(self._pending)
                start.record()
            t0 = perf_counter_ns()
            if ws:
                self._depth += 1
                head_before = self._ns["head"]
            try:
                with label:
                    out = fn(*args, **kwargs)
            finally:
                dt = perf_counter_ns() - t0
                if ws:
                    self._depth -= 1
                    dt -= self._ns["head"] - head_before
            if self._cuda:  # this call's entry comes after the heads it contains: they are indices [first, now)
                end.record()
                self._pending.append((section, start, end, first, len(self._pending)))
            else:
                self._ns[section] += dt
            return out

        return timed

    def __enter__(self) -> SplitTimer:
        self._cuda = any(p.is_cuda for m in self.models for p in m.parameters())
        for m in self.models:
            m.backbone.streams = self._wrap(m.backbone.streams, "backbone", "backbone")
            m.backbone.head = self._wrap(m.backbone.head, "head", "head")
            for owner, name in self._WORKSPACE_METHODS:
                obj = getattr(m, owner, None) if owner else m
                if obj is not None and hasattr(obj, name):
                    setattr(obj, name, self._wrap(getattr(obj, name), "workspace_modules", self.label_of(owner, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in self.models:
            for name in ("streams", "head"):
                m.backbone.__dict__.pop(name, None)
            for owner, name in self._WORKSPACE_METHODS:
                obj = getattr(m, owner, None) if owner else m
                if obj is not None:
                    obj.__dict__.pop(name, None)


# -------------------------------------------------------------------------------------------------------- one preset
@dataclass
class _Path:
    name: str
    model: PrismeModel
    row: str
    variant: str
    acts: torch.Tensor | None  # [B, 1, n] on the device
    budget: torch.Tensor | None  # [B, 1]
    counts: list[int]
    state: DecodeState


def _paths(models: dict[str, PrismeModel], batch: int, P: int, N: int, prompt: torch.Tensor,
           variants: Sequence[str] = ("-", *VARIANTS, COMPILED)) -> list[_Path]:
    """Every row x model (of `variants`; "-" = backbone_only) at one batch size.

    Paths of the same model share one state prefilled with the prompt `[B, P]` (untimed), which every run rewinds
    to P; backbone_only gets a state without a source bank.
    """
    cfg = models["opt"].cfg
    dev = prompt.device
    states: dict[tuple[str, bool], DecodeState] = {}
    out = []
    for row in ROWS:
        acts, counts = row_plan(cfg, row, batch)
        for variant in ("-",) if acts is None else [v for v in (*VARIANTS, COMPILED) if v in models]:
            if variant not in variants:
                continue
            model_name = "opt" if variant == "-" else variant
            key = (model_name, acts is not None)
            if key not in states:
                states[key] = models[model_name].new_decode_state(batch, max_len=P + N, bank=acts is not None)
                with torch.inference_mode():
                    states[key].prefill(prompt, logits="none")
            budget = None if acts is None else torch.tensor(counts, device=dev).unsqueeze(1)  # [B, 1]
            a = None if acts is None else acts.to(dev).unsqueeze(1)  # [B, 1, n]
            name = row if acts is None else f"{variant}/{row}"
            out.append(_Path(name, models[model_name], row, variant, a, budget, counts, states[key]))
    return out


def _decode(path: _Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Forced decode of `tokens` `[B, N]`, one step at a time, with the path's actions; logits `[B, 1, V]` per step."""
    policy = None if path.acts is None else Forced(path.acts, path.budget)  # None: the backbone alone
    return [path.state.decode_step(tokens[:, i:i + 1], policy=policy).logits for i in range(tokens.shape[1])]


def rewind_path(path: _Path, length: int) -> _Path:
    """`DecodeState.rewind` the path's state to `length` positions; returns the path (for chaining into `_decode`)."""
    path.state.rewind(length)
    return path


def make_sequence(vocab_size: int, batch: int, length: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """Predetermined token ids `[batch, length]` from a private generator, on `device`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g).to(device)
