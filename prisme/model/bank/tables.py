"""Per-vocabulary bank tables (`DecodeOptions.bank_tables`): the bank's and the query's projections of the token
embeddings, served by lookup in decoding.

Notation: B rows, C new positions, V vocab, d backbone width, w workspace width.

On a llama backbone the "embedding" source stream of a position is `tok_emb[token]`: every projection of it through
its norm is a function of the token alone. So for each such term the decode step reads

    KV_tab[v] = [W_K n(E_v), W_V n(E_v)]  ([V, 2w]),  P_tab[v] = P n(E_v)  ([V, w])
    S_tab[v] = W_K' n(E_v), S_tab[V] = 0                                   ([V + 1, w]: the token shift)

With `bank_key="preceding"` the key reads the previous token alone: KV_tab[v] = [0, W_V n(E_v)] and S_tab[v] =
W_K n(E_v), so an entry is the same two lookups and one sum as with the shift (0 + k is k, exactly).

instead of projecting `[B, C, d]` rows: the same numbers (the projection of the same vector; float64 agrees to
rounding), one gather per table. The shift's memory of such a term is the previous token id `[B]` (V before
position 0, whose shifted part is zero), not its normed stream. Other terms are projected as
`SourceBank.from_inputs` does. Tables are rebuilt when a weight they read changes (its version counter) or
moves. The cost model prices each lookup as w ops, one per element read (`prisme.costs.analytic.bank_lookup_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prisme.model.bank.source import SourceBank, lagged
from prisme.model.outputs import Streams
from prisme.options import DecodeOptions


def _modules(bank: SourceBank) -> dict[str, torch.nn.Module]:
    """Every module a table reads, by a stable name (its weights key the cache)."""
    cfg = bank.cfg
    mods: dict[str, torch.nn.Module] = {"tok_emb": bank.embedding, "norm": bank.norm_of("embedding")}
    for i, t in enumerate(cfg.bank_terms):
        if t == "embedding":
            mods["K"], mods["V"] = bank.key_projection(i, t)
            if cfg.bank_shift:
                mods["S"] = bank.shift_projection(i, t)
    for i, t in enumerate(cfg.query_terms):
        if t == "embedding":
            mods["P"] = bank.query_projection(i, t)
    return mods


def version_counter(p: torch.Tensor) -> int:
    """The tensor's in-place version counter (-1 for an inference tensor, which keeps none: asked first, since reading
    its counter raises, and a raise per weight per step cost a decode step of a model built under inference mode
    ~0.05 ms)."""
    return -1 if p.is_inference() else p._version


def _param_key(params: list[torch.Tensor]) -> tuple:
    return tuple((version_counter(p), p.data_ptr(), p.dtype) for p in params)


def bank_tables(bank: SourceBank) -> dict[str, torch.Tensor]:
    """{"KV", "S", "S2", "P"}: the tables of the embedding term (those it has; "KV" is K_tab and V_tab side by side,
    `[V, 2w]`, and "S2" is S_tab beside zeros, `[V + 1, 2w]`: two lookups and one sum write a bank entry), cached on
    the bank until a weight they read changes: in place (its version counter), moved or retyped (its storage and
    dtype; `model.to`, `load_state_dict` and optimiser steps all do one of these). A decode step checks the weights
    it built them from without looking the modules up again, so a submodule replaced by assignment after the first
    lookup is not seen: call `clear_bank_tables(bank)` after such surgery."""
    cached = bank.__dict__.get("_table_cache")
    if cached is not None and cached[1] == _param_key(cached[0]):
        return cached[2]
    mods = _modules(bank)
    params = [p for m in mods.values() for p in m._parameters.values() if p is not None]  # leaf modules
    with torch.no_grad():
        h = mods["norm"](mods["tok_emb"].weight)  # [V, d] n(E_v)
        out = {k: mods[k](h) for k in ("P",) if k in mods}  # [V, w]
        if "K" in mods and bank.cfg.bank_key == "preceding":  # the key is the previous token's: the shift table's
            out["KV"] = torch.cat([torch.zeros_like(mods["K"](h)), mods["V"](h)], -1)  # [V, 2w]: [0, V_tab]
            out["S"] = torch.cat([mods["K"](h), h.new_zeros(1, bank.cfg.w)])  # [V + 1, w]: row V, no position
        elif "K" in mods:
            out["KV"] = torch.cat([mods["K"](h), mods["V"](h)], -1)  # [V, 2w]
        if "S" in mods:
            out["S"] = torch.cat([mods["S"](h), h.new_zeros(1, bank.cfg.w)])  # [V + 1, w]: row V, no position
        if "S" in out:
            out["S2"] = torch.cat([out["S"], torch.zeros_like(out["S"])], -1)  # [V + 1, 2w]: added to KV rows
    object.__setattr__(bank, "_table_cache", (params, _param_key(params), out))  # never in a state dict
    return out


def clear_bank_tables(bank: SourceBank) -> None:
    """Forget the cached tables: the next lookup rebuilds them from the bank's modules as they are now."""
    bank.__dict__.pop("_table_cache", None)


def step_entries(bank: SourceBank, options: DecodeOptions, st: Streams, tokens: torch.Tensor,
                 prev: list[torch.Tensor] | None, out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Bank keys and values side by side `[B, C, 2w]` (K, then V) of the new positions of `st` (its tokens `[B, C]`),
    and what each bank term's shift memory keeps of them (the normed stream `[B, C, d]`, or the token ids `[B, C]`
    of a table term).

    `prev`: each term's memory of the position before the chunk (`BankCache.prev`), None at position 0 or without
    a shift. `out` `[B, C, 2w]` (e.g. the bank's own slice for these positions): the entries are written there and it
    is returned (a bank served by one table term writes it in the call that sums its two lookups). Without
    `options.bank_tables` this is `SourceBank.inputs` + `SourceBank.from_inputs`, unchanged."""
    cfg = bank.cfg
    served = options.table_terms
    if not served.intersection(cfg.bank_terms):
        hs = bank.inputs(st)
        KV = torch.cat(bank.from_inputs(hs, prev), -1)
        return (KV, hs) if out is None else (out.copy_(KV), hs)
    tabs = bank_tables(bank)
    KV = None
    keep: list[torch.Tensor] = []
    alone = out is not None and len(cfg.bank_terms) == 1 and out.dtype == tabs["KV"].dtype
    for i, t in enumerate(cfg.bank_terms):
        if t in served:
            kv = F.embedding(tokens, tabs["KV"])  # [B, C, 2w]
            if cfg.reads_previous:
                before = tokens.new_full(tokens[:, :1].shape, cfg.vocab_size) if prev is None else prev[i].view(-1, 1)
                shifted = before if tokens.shape[1] == 1 else torch.cat([before, tokens[:, :-1]], 1)  # [B, C]
                if alone:  # K + shifted K, V + 0, straight into the bank (the same sums)
                    keep.append(tokens)
                    return torch.add(kv, F.embedding(shifted, tabs["S2"]), out=out), keep
                kv.narrow(-1, 0, cfg.w).add_(F.embedding(shifted, tabs["S"]))  # the key's shifted part (row V: none)
            keep.append(tokens)
        else:
            h = bank.norm_of(t)(st.src[t])  # [B, C, d]
            k, v = bank.key_projection(i, t)
            k, v = k(lagged(h, None if prev is None else prev[i]) if cfg.bank_key == "preceding" else h), v(h)
            if cfg.bank_shift:
                k = k + bank.shift_projection(i, t)(lagged(h, None if prev is None else prev[i]))
            kv = torch.cat([k, v], -1)
            keep.append(h)
        KV = kv if KV is None else KV + kv
    return (KV, keep) if out is None else (out.copy_(KV), keep)


def entries_from_ids(bank: SourceBank, ids: torch.Tensor, tabs: dict[str, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """The bank entries `[b, Tb, 2w]` (K, then V) of positions 0..Tb-1 from their token ids `[b, Tb]` alone (the
    decode option `bank_store="ids"`: an "embedding" bank served by its tables; `tabs`: those tables, given): the
    same sums `step_entries` writes, K_tab + shifted K_tab' of the previous id (none before position 0), V_tab + 0."""
    tabs = bank_tables(bank) if tabs is None else tabs
    kv = F.embedding(ids, tabs["KV"])  # [b, Tb, 2w]
    if not bank.cfg.reads_previous:
        return kv
    before = F.pad(ids[:, :-1], (1, 0), value=bank.cfg.vocab_size)  # [b, Tb]: the previous ids, V before 0
    return kv.add_(F.embedding(before, tabs["S2"]))


def decoded_query(bank: SourceBank, options: DecodeOptions, st: Streams,
                  tabs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """`SourceBank.query` of decoded queries (`st.ids` `[B, Q]` set), the embedding term from its table where
    `options` serve it so (`tabs`: the bank's tables, given; None: `bank_tables(bank)`)."""
    cfg = bank.cfg
    if "embedding" not in options.table_terms or "embedding" not in cfg.query_terms:
        return bank.query(st)
    tab = (bank_tables(bank) if tabs is None else tabs)["P"]
    z = None
    for i, t in enumerate(cfg.query_terms):
        if t == "embedding":
            part = F.embedding(st.ids, tab)  # [B, Q, w]
        else:
            part = bank.query_projection(i, t)(bank.norm_of(t)(st.src[t]))
        z = part if z is None else z + part
    return bank.finish_query(z)


def shift_memory(cfg, options: DecodeOptions, batch: int, like: torch.Tensor) -> list[torch.Tensor]:
    """A fresh shift memory per bank term: zeros `[B, d]`, or `[B]` ids (V: no previous position) for a table term;
    none where no key reads the position before (`PrismeConfig.reads_previous`)."""
    if not cfg.reads_previous:
        return []
    served = options.table_terms
    return [torch.full((batch,), cfg.vocab_size, dtype=torch.long, device=like.device) if t in served
            else like.new_zeros(batch, cfg.d_model) for t in cfg.bank_terms]


def clear_shift_memory(cfg, options: DecodeOptions, prev: list[torch.Tensor]) -> None:
    """Set each term's shift memory (`shift_memory`) back to "no previous position", in place."""
    for p, t in zip(prev, cfg.bank_terms):
        p.fill_(cfg.vocab_size if t in options.table_terms else 0)
