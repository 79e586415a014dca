"""The source bank's cost terms (the conventions of `prisme.costs.analytic`, which uses them): what a position computes
of its bank (the projections of its entries and its query z, or their lookups where a decode state serves them from
tables), the token shift's, and the attention of a decode step's fired row that reads a bank kept as ids through the
tables (`prisme.model.bank.tables.IdRead`) instead of over entries looked up per position."""

from __future__ import annotations

from prisme.config import PrismeConfig
from prisme.options import PROJECTED, SLOT_KV_CACHE, DecodeOptions


def checked_context(cfg: PrismeConfig, T: int) -> int:
    """The context T (keys a new token attends to, its own included) as an int, ValueError outside [1, T_max]."""
    if isinstance(T, bool) or int(T) != T or not 1 <= T <= cfg.max_seq_len:
        raise ValueError(f"context T must be an int in [1, T_max={cfg.max_seq_len}] for {cfg.name!r}, got {T!r}")
    return int(T)


def bank_projection_ops(cfg: PrismeConfig, entries: int = 1, query: bool = True,
                        decode: DecodeOptions = PROJECTED) -> int:
    """K, V and z of the new position: three d -> w projections (seed 000), one K and one V per bank source term and
    one z projection per query source term; where a decode state serves them from tables (`decode.bank_tables`), an
    embedding term's are lookups of w-rows, w ops each. `entries`: those computed (`bank_reads`), `query`: z is."""
    nb, nq = decode.served(cfg.bank_terms), decode.served(cfg.query_terms)
    projected = 2 * (len(cfg.bank_terms) - nb) * entries + (len(cfg.query_terms) - nq) * query
    return projected * 2 * cfg.d_model * cfg.w + (2 * nb * entries + nq * query) * cfg.w


def bank_shift_ops(cfg: PrismeConfig, entries: int = 1, decode: DecodeOptions = PROJECTED) -> int:
    """The token shift's key projection W_K' n(X_{j-1}) of each computed entry, per bank source term (0 without it);
    a lookup (w ops) for a term served from its table."""
    if not cfg.bank_shift:
        return 0
    nb = decode.served(cfg.bank_terms)
    return ((len(cfg.bank_terms) - nb) * 2 * cfg.d_model * cfg.w + nb * cfg.w) * entries


def bank_lookup_ops(cfg: PrismeConfig, entries: int = 1, query: bool = True, decode: DecodeOptions = PROJECTED
                    ) -> int:
    """The part of `bank_ops` that is table lookups (`decode.bank_tables`), not matmuls: a named allowance in the tie
    to counted FLOPs (0 without tables)."""
    nb, nq = decode.served(cfg.bank_terms), decode.served(cfg.query_terms)
    return ((2 * nb + (nb if cfg.bank_shift else 0)) * entries + nq * query) * cfg.w


def bank_reads(cfg: PrismeConfig, T: int | None, reads: bool, decode: DecodeOptions = PROJECTED,
               tables: bool = False) -> tuple[int, bool]:
    """(bank entries a position computes, whether it computes its query's z). Kept entries (`decode.bank_store`
    "entries"): its own, and z (at every position a policy prices). Kept ids ("ids"): nothing where its workspace
    does not run; where it runs (`reads`), the lookups of every entry of its context (T) and z, or z alone where its
    editor reads the ids through the tables (`tables`: `reads_through_tables`)."""
    if decode.bank_store == "entries":
        return 1, True
    if not reads:
        return 0, False
    return (0 if tables else checked_context(cfg, T)), True


def bank_ops(cfg: PrismeConfig, T: int | None = None, reads: bool = True, decode: DecodeOptions = PROJECTED,
             tables: bool = False) -> dict[str, int]:
    """The source bank's terms for one position at context T whose workspace runs (`reads`) or not, in a decode state
    with options `decode` (its editor reading a bank kept as ids through the tables: `tables`): `bank_projection`
    (and `bank_shift` where the bank has one), as `bank_reads` counts them."""
    entries, query = bank_reads(cfg, T, reads, decode, tables)
    out = {"bank_projection": bank_projection_ops(cfg, entries, query, decode)}
    if cfg.bank_shift:
        out["bank_shift"] = bank_shift_ops(cfg, entries, decode)
    return out


def tables_read_pays(cfg: PrismeConfig, T: int) -> bool:
    """Whether reading a bank of T ids through the tables (`id_read_attention_ops`) takes fewer ops per slot and block
    than attending over T looked-up entries (4 T w; their lookups, which it also saves, left out): about T > 1.5 V.
    A decode step's fired rows read so where it pays (`prisme.model.bank.cache.BankCache.read`, at the longest row's
    length), else they look their entries up."""
    return sum(id_read_attention_ops(cfg, T)) < 4 * checked_context(cfg, T) * cfg.w


def reads_through_tables(cfg: PrismeConfig, T: int, decode: DecodeOptions, router: bool, n_actions: int,
                         controller_steps: int, optimised: bool | str) -> bool:
    """Whether a position's editor reads a bank kept as ids (`decode.bank_store == "ids"`) through the tables
    (`IdRead`) rather than over entries looked up: the deployed decode step's plan (`prisme.model.plans.choose`'s
    "budget1": a router's one action, no controller step after it, on the editor without a slot K/V cache,
    `optimised != SLOT_KV_CACHE`) at a context where that read pays (`tables_read_pays`). Two plans that also run
    such a trace look the entries up and are priced here as that step: a prompt chunk's positions (the "routed" plan)
    and a compiled editor's fixed-shape step; and a fired row shorter than the longest of its step reads as that one
    does."""
    return (router and decode.bank_store == "ids" and n_actions == 1 and controller_steps == 0
            and optimised != SLOT_KV_CACHE and tables_read_pays(cfg, T))


def id_read_attention_ops(cfg: PrismeConfig, T: int) -> tuple[int, int]:
    """(products, gathers) of one slot's attention in one editor block over a bank of T ids read through the tables,
    in place of QK^T and AV over T entries (4 T w). Products, 2 ops per multiply-add: the query against K_tab `[V, w]`
    (and S_tab `[V + 1, w]` where a key reads the position before it) and the weights summed per id against V_tab
    `[V, w]`. Gathers, one op per element (the lookups' convention), per head: each position's score (and its
    previous position's, and their sum) and the scatter of its weight, T each; not a matmul (a named allowance in the
    tie to counted FLOPs)."""
    prev = cfg.reads_previous
    w, V = cfg.w, cfg.vocab_size
    return 4 * V * w + (2 * (V + 1) * w if prev else 0), cfg.n_ws_heads * checked_context(cfg, T) * (2 + 2 * prev)
