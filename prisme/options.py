"""Runtime options, apart from the architecture (`PrismeConfig`): how a decode state keeps and serves the source bank
(`DecodeOptions`) and how the editor runs (`ExecutionOptions`: its slot K/V cache, compiling). Every choice computes
the same numbers (tests/test_decode_tables.py, test_bank_ids.py, test_compiled_editor.py); the cost model prices what
each one computes (`prisme.costs.analytic.bank_ops`, `action_editor_ops`).

    state = model.new_decode_state(8, options=DecodeOptions(bank_tables=True, bank_store="ids"))
    model.set_execution(ExecutionOptions(compile="auto"))
"""

from __future__ import annotations

from dataclasses import dataclass

from prisme.checks import COMPILE_SETTINGS, check_choice, check_fields, is_int
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
            runs, or at budget 1 read through the tables without writing an entry (`bank.tables.IdRead`), and the
            cost model prices those lookups there instead of one entry at every position).
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


EDITOR_MODE = "default"  # `ExecutionOptions.compile_mode`: torch.compile's mode for the editor's graphs
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
# Fewer active positions than this in one action group run the eager pass: below it the compiled graph's per-call
# cost (guards, dynamic-size bookkeeping: ~1 ms on a 2-core x86 CPU) exceeds what it saves. Measured there (demo
# preset, 1 thread, one single-slot action, bank of 128; eager vs compiled ms per call): N = 8 0.92 vs 1.93,
# N = 64 2.53 vs 2.50, N = 128 4.17 vs 4.11, N = 256 12.9 vs 7.6 (scratch measurements, docs/benchmarks.md).
MIN_POSITIONS = 128
SLOT_KV_CACHE = "slot_kv_cache"  # the cost model's column of an optimised editor that keeps its slot K/V (`column`)


@dataclass(frozen=True)
class ExecutionOptions:
    """How a model's editor runs, a runtime choice apart from the architecture: every choice computes the same numbers
    (tests/test_compiled_editor.py, test_contracts.py). A model runs with `PrismeModel(cfg, ..., execution=...)` or
    `model.set_execution(...)`; the editor reads them there and nowhere else (`SparseEditor`).

    Args:
        slot_kv_cache: with `cfg.optimised`, the editor keeps each position's slot K/V (a `SlotKV`) and projects only
            the slots an action changes. Off by default: it does fewer ops but ran slower on CPU at every preset's
            shape measured (docs/benchmarks.md), so the editor recomputes every slot's K/V, as the seed counts.
        compile: "off" (the eager editor), "auto" (the editor's passes under torch.compile where it works, else eager
            after one warning) or "strict" (a ValueError where it does not); `checks.COMPILE_SETTINGS`. A compiled
            editor recomputes every slot's K/V (no slot K/V cache) and decodes a step on fixed-shape graphs.
        compile_mode: torch.compile's mode of the editor's graphs.
        min_positions: action groups with fewer active positions run the eager pass (`MIN_POSITIONS`; the dynamic
            graphs of many positions per row: a decode step's fixed-shape graphs run at any size).
        static_decode: a compiled editor runs decode steps (one query per row) on fixed-shape graphs.
    """

    slot_kv_cache: bool = False
    compile: str = "off"
    compile_mode: str | None = EDITOR_MODE
    min_positions: int = MIN_POSITIONS
    static_decode: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "ExecutionOptions: ")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "ExecutionOptions: ")
        check_choice("compile_mode", self.compile_mode, COMPILE_MODES, "ExecutionOptions: ")
        if not is_int(self.min_positions) or self.min_positions < 0:
            raise ValueError(f"ExecutionOptions: min_positions must be an int >= 0, got {self.min_positions!r}")

    def column(self, optimised: bool) -> bool | str:
        """The cost model's column (`optimised` of `prisme.costs.analytic`) of a model of `cfg.optimised=optimised`
        run with these options: False (the seed's accounting), True (the optimised modules) or `SLOT_KV_CACHE` (and
        the editor's slot K/V cache)."""
        return SLOT_KV_CACHE if optimised and self.slot_kv_cache else optimised


EAGER = ExecutionOptions()
"""The default: the eager editor, recomputing every slot's K/V."""


@dataclass(frozen=True)
class Runtime:
    """How one generation runs, apart from what it generates (`prisme.generate(..., runtime=...)`): its decode state's
    bank options (`decode`; None: the model's `decode_options`), how its editor runs (`execution`; None: the model's
    `execution`), so one trained model generates either way without a copy of its weights, and the prompt's prefill
    chunk size (None: one chunk)."""

    decode: DecodeOptions | None = None
    execution: ExecutionOptions | None = None
    prefill_chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name, kind in (("decode", DecodeOptions), ("execution", ExecutionOptions)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, kind):
                raise ValueError(f"Runtime: {name} must be a prisme.options.{kind.__name__} or None, got "
                                 f"{type(v).__name__}")
        c = self.prefill_chunk_size
        if c is not None and (not is_int(c) or c < 1):
            raise ValueError(f"Runtime: prefill_chunk_size must be a positive int or None, got {c!r}")
