"""Decode options: how a decode state keeps and serves the source bank, a runtime choice apart from the architecture
(`PrismeConfig`). Every choice decodes the same numbers (tests/test_decode_tables.py, test_bank_ids.py); the cost
model prices what each one computes (`prisme.costs.analytic.bank_ops`).

    state = model.new_decode_state(8, options=DecodeOptions(bank_tables=True, bank_store="ids"))
"""

from __future__ import annotations

from dataclasses import dataclass

from prisme.checks import check_fields
from prisme.config import PrismeConfig

BANK_STORES = ("entries", "ids")  # `DecodeOptions.bank_store`


@dataclass(frozen=True)
class DecodeOptions:
    """How a decode state keeps the bank; checked when made, and against a model by `check(cfg)` (which
    `PrismeModel` runs on its default options and `new_decode_state` on a state's).

    Args:
        bank_tables: serve the bank's and the query's projections of the token embeddings (K, V, the shift's K', z of
            each "embedding" term) from per-vocabulary tables `[V, w]` (exact: that stream is a function of the token;
            llama family: gpt2 adds positions), priced as lookups.
        bank_store: what the state keeps of the bank: "entries" (K and V of every position) or "ids" (with
            `bank_tables` and an "embedding" bank: its token ids only; K and V are looked up where the workspace
            runs, and the cost model prices those lookups there instead of one entry at every position).
    """

    bank_tables: bool = False
    bank_store: str = "entries"

    def __post_init__(self) -> None:
        check_fields(self, "DecodeOptions: ")
        if self.bank_store not in BANK_STORES:
            raise ValueError(f"DecodeOptions: bank_store must be one of {BANK_STORES}, got {self.bank_store!r}")
        if self.bank_store == "ids" and not self.bank_tables:
            raise ValueError("DecodeOptions: bank_store='ids' keeps token ids only: it needs bank_tables=True")

    @property
    def table_terms(self) -> frozenset[str]:
        """The source terms served from tables: "embedding", where `bank_tables` is on."""
        return frozenset({"embedding"}) if self.bank_tables else frozenset()

    def served(self, terms: tuple[str, ...]) -> int:
        """How many of `terms` (a config's `bank_terms` or `query_terms`) are served from tables."""
        return sum(t in self.table_terms for t in terms)

    def check(self, cfg: PrismeConfig) -> DecodeOptions:
        """ValueError unless a model of `cfg` can decode with these options; returns self."""
        where = f"DecodeOptions for {cfg.name!r}: "
        if self.bank_tables and not (cfg.use_workspace and cfg.family == "llama"
                                     and "embedding" in cfg.bank_terms + cfg.query_terms):
            raise ValueError(f"{where}bank_tables=True needs a llama workspace model whose bank_source or query_source "
                             f"reads 'embedding'")
        if self.bank_store == "ids" and set(cfg.bank_terms) != {"embedding"}:
            raise ValueError(f"{where}bank_store='ids' keeps token ids only: it needs bank_source='embedding', got "
                             f"bank_source={cfg.bank_source!r}")
        return self


PROJECTED = DecodeOptions()
"""The default: every position's entry projected and kept (what a model decodes with unless it is given others)."""
