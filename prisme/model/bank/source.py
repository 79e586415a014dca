"""The source bank: what the workspace reads of the context, and the query each position reads it with.

Notation: B rows, T positions (Tq queries), d backbone width, w workspace width.

Each bank term ("residual", "embedding", "layer<i>": `cfg.bank_terms`) is a stream of the backbone pass, normed and
projected to keys and values; the query z of a position is the same for `cfg.query_terms`:

    K_j = sum_terms W_K n(X_j) [+ W_K' n(X_{j-1}) with `bank_shift`],   V_j = sum_terms W_V n(X_j)
    z_t = rms(sum_terms P n(X_t))                                        (rms with `z_norm`)

What a key reads is `cfg.bank_key` (`KEY_READS`): "current" is the above; "preceding" reads the position before
alone, K_j = sum_terms W_K n(X_{j-1}) (zero at j = 0), so that a query matching what came before j reads the value
of j, what followed it (an induction read in one step). Either way a key reads at most one earlier position, which
is what a decode state remembers of each row (`PrismeConfig.reads_previous`).

The first bank term keeps the seed's names (`bank_norm`, `W_K`, `W_V`, `P`); other streams have their own norm in
`src_norm`, other terms their projections in `W_K_more`, `W_V_more`, `P_more`; the shift adds `W_K_shift` (and
`W_K_shift_more`). `SourceBank.build` makes those modules and the model registers them under those names (checkpoint
keys are those of every earlier release); a `SourceBank` reads them from the model's registry, and nothing outside
this package names them. Decoding serves an "embedding" term from per-vocabulary tables (`prisme.model.bank.tables`) and
keeps the bank in a `BankCache` (`prisme.model.bank.cache`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import PrismeConfig
from prisme.model.attention import RMSNorm, linear
from prisme.model.backbone import apply_norm
from prisme.model.outputs import Streams

KEY_READS = {"current": "K_j = W_K n(X_j) [+ W_K' n(X_{j-1}) with bank_shift]",
             "preceding": "K_j = W_K n(X_{j-1}): the position before j alone (no bank_shift)"}
"""`cfg.bank_key`: what the key of position j reads."""

PROJECTIONS = ("W_K", "W_V", "P", "W_K_shift", "W_K_more", "W_V_more", "P_more", "W_K_shift_more")
"""The bank's d -> w projections, in the order the model initialises them (a checkpoint's draws depend on it)."""
COMPONENTS = {"W_K": "bank_projection", "W_V": "bank_projection", "P": "bank_projection",
              "W_K_more": "bank_projection", "W_V_more": "bank_projection", "P_more": "bank_projection",
              "W_K_shift": "bank_shift", "W_K_shift_more": "bank_shift"}
"""The cost model's component of each projection (`prisme.costs.counting.OpsCounter` tags them by it)."""


def lagged(h: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """`h` `[B, T, ...]` one position later: position j holds position j-1's (`prev` `[B, ...]` before the first; None:
    zeros, position 0 has no previous position)."""
    before = h.new_zeros(h[:, :1].shape) if prev is None else prev.unsqueeze(1).to(h.dtype)
    return torch.cat([before, h[:, :-1]], dim=1)


class SourceBank:
    """The bank's and the query's norms and projections for `cfg`'s sources (see the module docstring).

    The modules live in the model's registry (`modules`: its `_modules`, the one place a state dict, `to`, an
    optimiser or an assignment such as `model.P = ...` sees); the bank reads them from there by name, so it can never
    hold a stale module. `build` makes them, `SourceBank(cfg, model._modules, model.backbone._modules)` reads them.
    """

    def __init__(self, cfg: PrismeConfig, modules: dict[str, nn.Module], backbone: dict[str, nn.Module]):
        self.cfg = cfg
        self.modules = modules
        self.backbone = backbone  # the backbone's registry: decoding's tables read its token embedding

    @property
    def embedding(self) -> nn.Module:
        """The backbone's token embedding."""
        return self.backbone["tok_emb"]

    def __getattr__(self, name: str) -> nn.Module:  # bank.W_K, bank.P_more, ... : the registry's modules
        try:
            return self.__dict__["modules"][name]
        except KeyError:
            raise AttributeError(name) from None

    @staticmethod
    def build(cfg: PrismeConfig) -> dict[str, nn.Module]:
        """The bank's modules by name, in the order the model registers them (each draws its initial weights)."""
        d, w = cfg.d_model, cfg.w
        lin = lambda: nn.Linear(d, w, bias=False)  # noqa: E731
        bank, query = cfg.bank_terms, cfg.query_terms
        mods: dict[str, nn.Module] = {"bank_norm": RMSNorm(d, cfg.norm_eps)}
        mods["W_K"], mods["W_V"], mods["P"] = lin(), lin(), lin()
        extra_streams = [t for t in dict.fromkeys(bank + query) if t != bank[0]]
        if extra_streams:
            mods["src_norm"] = nn.ModuleDict({t: RMSNorm(d, cfg.norm_eps) for t in extra_streams})
        if len(bank) > 1:
            mods["W_K_more"] = nn.ModuleDict({t: lin() for t in bank[1:]})
            mods["W_V_more"] = nn.ModuleDict({t: lin() for t in bank[1:]})
        if len(query) > 1:
            mods["P_more"] = nn.ModuleDict({t: lin() for t in query[1:]})
        if cfg.bank_shift:
            mods["W_K_shift"] = lin()
            if len(bank) > 1:
                mods["W_K_shift_more"] = nn.ModuleDict({t: lin() for t in bank[1:]})
        return mods

    @staticmethod
    def names() -> tuple[str, ...]:
        """Every name `build` can register (the model's parameter groups put them in the workspace's)."""
        return ("bank_norm", "src_norm", *PROJECTIONS)

    # ------------------------------------------------------------------ what the model needs of its modules
    def projections(self) -> list[nn.Module]:
        """Every d -> w projection (modules whose weights are matrices), in `PROJECTIONS` order."""
        return [self.modules[n] for n in PROJECTIONS if n in self.modules]

    def components(self) -> dict[nn.Module, str]:
        """Each projection's leaf `nn.Linear` -> its cost-model component (`COMPONENTS`)."""
        out = {}
        for name, comp in COMPONENTS.items():
            mod = self.modules.get(name)
            for lin in (mod.values() if isinstance(mod, nn.ModuleDict) else [mod] if mod is not None else []):
                out[lin] = comp
        return out

    def norm_of(self, term: str) -> nn.Module:
        """The norm of a source term's stream."""
        mods = self.modules
        return mods["bank_norm"] if term == self.cfg.bank_terms[0] else mods["src_norm"][term]

    def key_projection(self, i: int, term: str) -> tuple[nn.Module, nn.Module]:
        """(W_K, W_V) of the i-th bank term."""
        return (self.W_K, self.W_V) if i == 0 else (self.W_K_more[term], self.W_V_more[term])

    def shift_projection(self, i: int, term: str) -> nn.Module:
        """W_K' of the i-th bank term (`bank_shift`)."""
        return self.W_K_shift if i == 0 else self.W_K_shift_more[term]

    def query_projection(self, i: int, term: str) -> nn.Module:
        """P of the i-th query term."""
        return self.P if i == 0 else self.P_more[term]

    def as_streams(self, x: Streams | torch.Tensor) -> Streams:
        """`x` as `Streams`; a bare tensor is H, which only a bank and query of the residual stream may take."""
        if isinstance(x, Streams):
            return x
        cfg = self.cfg
        if not cfg.default_sources and set(cfg.bank_terms + cfg.query_terms) != {"residual"}:
            raise ValueError(f"this model's workspace reads {cfg.bank_source!r} / {cfg.query_source!r}, "
                             f"not only H: pass model.streams(tokens) instead of a residual-stream tensor")
        return Streams(x, {"residual": x})

    # ------------------------------------------------------------------ the bank's entries
    def inputs(self, st: Streams | torch.Tensor) -> list[torch.Tensor]:
        """The normed source stream of each bank term, `[B, T, d]` each."""
        st = self.as_streams(st)
        return [apply_norm(self.norm_of(t), st.src[t]) for t in self.cfg.bank_terms]  # (functional: per step)

    def from_inputs(self, hs: list[torch.Tensor], prev: list[torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank keys and values `[B, T, w]` from the normed streams `hs` of `inputs`.

        Where a key reads position j-1 (`cfg.reads_previous`), `prev` holds each term's normed stream `[B, d]` of the
        position before the first of `hs` (None: the first position is position 0, whose previous part is zero).
        """
        terms, preceding = self.cfg.bank_terms, self.cfg.bank_key == "preceding"
        keyed = [lagged(h, None if prev is None else prev[i]) for i, h in enumerate(hs)] if preceding else hs
        K, V = linear(keyed[0], self.W_K), linear(hs[0], self.W_V)  # (functional: a decode step runs this)
        for t, k, h in zip(terms[1:], keyed[1:], hs[1:]):
            K, V = K + linear(k, self.W_K_more[t]), V + linear(h, self.W_V_more[t])
        if self.cfg.bank_shift:
            for i, (t, h) in enumerate(zip(terms, hs)):
                shifted = lagged(h, None if prev is None else prev[i])  # [B, T, d]: position j holds n(X_{j-1})
                K = K + linear(shifted, self.shift_projection(i, t))
        return K, V

    def entries(self, st: Streams | torch.Tensor,
                prev: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank keys and values `[B, T, w]` of the positions of `st` (`Streams`, or H for the seed's sources)."""
        return self.from_inputs(self.inputs(st), prev)

    # ------------------------------------------------------------------ the query
    def query(self, st: Streams | torch.Tensor) -> torch.Tensor:
        """z `[B, Tq, w]` of query positions (`Streams`, or H for the seed's sources)."""
        st = self.as_streams(st)
        terms = self.cfg.query_terms
        z = self.P(self.norm_of(terms[0])(st.src[terms[0]]))
        for t in terms[1:]:
            z = z + self.P_more[t](self.norm_of(t)(st.src[t]))
        return self.finish_query(z)

    def finish_query(self, z: torch.Tensor) -> torch.Tensor:
        """z's scale: rms-normalised with `cfg.z_norm`."""
        return F.rms_norm(z, (self.cfg.w,), eps=self.cfg.norm_eps) if self.cfg.z_norm else z
