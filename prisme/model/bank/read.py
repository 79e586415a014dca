"""How the editor reads the causal bank: one interface (`BankRead`: `attend(q)`), three readers.

Notation: B rows, N query positions (slots of one action group: k per position), Tb bank positions, w width, nh heads
of hd, V vocab.

    PackedRead   the bank K, V `[B, Tb, w]` of a teacher-forced pass or a decode step, read by N positions packed per
                 row (each row's positions get ranks 0..n_b-1 and attend to their own row's bank in place);
    EntryRead    the entries K, V `[N, Tb, w]` of N rows of one query each (a decode step's fired rows);
    IdRead       the same rows kept as token ids `[N, Tb]` (`DecodeOptions(bank_store="ids")`), read through the
                 bank's tables (`prisme.model.bank.tables`) without writing an entry.

Each is the same attention to rounding: `attend` takes the queries `[N, k, w]` and returns `[N, k, w]`, softmax(q K^T
/ sqrt(hd)) V per head over the keys each query may read. The per-row readers also answer `rows(i, j, mask)` (the
same read for rows i..j-1, each reading the keys `mask` `[j - i, Tb]` allows). `BankCache.read` chooses between an
entry read and an id read as the cost model prices them (`read_rows`); the editor (`prisme.model.editor`) only calls
`attend`.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
import torch.nn.functional as F

from prisme.model.bank.source import SourceBank
from prisme.model.bank.tables import bank_tables, entries_from_ids


class BankRead(Protocol):
    """What the editor reads of the bank: queries `[N, k, w]` -> attention outputs `[N, k, w]`."""

    def attend(self, q: torch.Tensor) -> torch.Tensor: ...


def bank_attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                b_idx: torch.Tensor | None, rank: torch.Tensor | None, full: bool) -> torch.Tensor:
    """The packed attention of `PackedRead` (and `EntryRead`, one query per row) from its parts: every size read from
    a shape, so one compiled graph serves all of them; a mask of None (with `full`, one query per row) reads every
    key. q `[N, k, w]`, K, V `[B, nh, Tb, hd]`, mask `[B, 1, n k, Tb]`, b_idx / rank `[N]` each position's row and
    rank (read only without `full`)."""
    N, k, w = q.shape
    B, nh = K.shape[0], K.shape[1]
    n = 1 if mask is None else mask.shape[2] // k
    if full:
        qp = q.reshape(B, n * k, nh, w // nh)
    else:
        qp = q.new_zeros(B, n, k, w).index_put((b_idx, rank), q).view(B, n * k, nh, w // nh)
    y = F.scaled_dot_product_attention(qp.transpose(1, 2), K, V, attn_mask=mask)  # [B, nh, nk, hd]
    y = y.transpose(1, 2).reshape(B, n, k, w)
    return y.view(N, k, w) if full else y[b_idx, rank]


class PackedRead:
    """The causal bank seen by N active positions, packed per batch row so attention reads K, V in place.

    Row b's active positions get ranks 0..n_b-1; queries are laid out `[B, N_max, k]`, so each row attends to its
    own bank with a `[B, 1, N_max k, Tb]` mask. Padding ranks attend to key 0 only (never all-masked: no NaN).
    `parts()` / `from_parts` carry it into a compiled graph as tensors.
    """

    def __init__(self, parts: tuple[torch.Tensor, ...], full: bool):
        self._parts, self.full = parts, full

    @classmethod
    def of(cls, K: torch.Tensor, V: torch.Tensor, bank_mask: torch.Tensor, b_idx: torch.Tensor, t_idx: torch.Tensor,
           n_heads: int, k: int) -> PackedRead:
        """The read of positions (b_idx, t_idx) `[N]` (k slots each) of the bank K, V `[B, Tb, w]` under its mask
        `[B, Tq, Tb]`."""
        B, Tb, w = K.shape
        Kh = K.view(B, Tb, n_heads, w // n_heads).transpose(1, 2)  # [B, nh, Tb, hd]
        Vh = V.view(B, Tb, n_heads, w // n_heads).transpose(1, 2)
        N = b_idx.numel()
        masks = bank_mask[b_idx, t_idx]  # [N, Tb]
        if bank_mask.shape[1] == 1:  # one query per row (decoding): rows are positions
            n_max, full = 1, N == B
            rank = torch.zeros_like(b_idx)
        else:
            counts = torch.bincount(b_idx, minlength=B)  # [B]
            n_max = int(counts.max())
            full = N == B * n_max  # every row has n_max positions, in order
            rank = torch.arange(N, device=K.device) - (torch.cumsum(counts, 0) - counts)[b_idx]
        if full:
            mask = masks.view(B, n_max, Tb)
        else:
            mask = torch.zeros(B, n_max, Tb, dtype=torch.bool, device=K.device)
            mask[:, :, 0] = True
            mask[b_idx, rank] = masks
        mask = mask.unsqueeze(2).expand(B, n_max, k, Tb).reshape(B, 1, n_max * k, Tb)
        return cls((Kh, Vh, mask, b_idx, rank), full)

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors `bank_attend` reads: (K, V `[B, nh, Tb, hd]`, mask `[B, 1, N_max k, Tb]`, b_idx, rank `[N]`)."""
        return self._parts

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q `[N, k, w]` -> attention output `[N, k, w]` over each position's causal bank."""
        return bank_attend(q, *self._parts, self.full)


class EntryRead:
    """The editor's attention over the banks of N rows as entries K, V `[N, Tb, w]`, each row one query (a decode
    step's fired rows)."""

    def __init__(self, K: torch.Tensor, V: torch.Tensor, n_heads: int):
        N, Tb, w = K.shape
        self.K = K.view(N, Tb, n_heads, w // n_heads).transpose(1, 2)  # [N, nh, Tb, hd]
        self.V = V.view(N, Tb, n_heads, w // n_heads).transpose(1, 2)
        self.mask: torch.Tensor | None = None

    def rows(self, i: int, j: int, mask: torch.Tensor | None) -> EntryRead:
        out = copy.copy(self)
        out.K, out.V, out.mask = self.K[i:j], self.V[i:j], mask
        return out

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        n, k, _ = q.shape
        m = None if self.mask is None else self.mask.view(n, 1, 1, -1).expand(n, 1, k, self.mask.shape[-1])
        return bank_attend(q, self.K, self.V, m, None, None, True)  # full: every row one query, in order


class IdRead:
    """The editor's attention over the banks of N rows kept as token ids (`bank_store="ids"`), read through the
    tables instead of from entries looked up per position: an entry is K_j = K_tab[x_j] + S_tab[x_{j-1}] and V_j =
    V_tab[x_j], so a query's score at j is (q . K_tab)[x_j] + (q . S_tab)[x_{j-1}] and its output is
    sum_v (sum of the weights of the positions holding v) V_tab[v]: per query and head, two products with the tables
    (`[V, hd]`), two gathers and one scatter over the Tb positions, instead of writing `[Tb, 2w]` entries and reading
    them again. The same attention as `bank_attend` over `entries_from_ids` to rounding (float64 agrees to ~1e-12).

    Args:
        bank: the model's `SourceBank` (an "embedding" bank served by its tables).
        ids: `[N, Tb]` each row's token ids at positions 0..Tb-1.
        n_heads: the editor's heads.
    """

    def __init__(self, bank: SourceBank, ids: torch.Tensor, n_heads: int, tabs: dict[str, torch.Tensor] | None = None):
        tabs, cfg = bank_tables(bank) if tabs is None else tabs, bank.cfg
        self.kv = tabs["KV"]  # [V, 2w]
        self.s = tabs["S"] if cfg.reads_previous else None  # [V + 1, w]
        self.ids, self.mask, self.nh = ids, None, n_heads
        self.prev = None if self.s is None else F.pad(ids[:, :-1], (1, 0), value=cfg.vocab_size)  # [N, Tb]

    def rows(self, i: int, j: int, mask: torch.Tensor | None) -> IdRead:
        out = copy.copy(self)
        out.ids, out.prev, out.mask = self.ids[i:j], None if self.prev is None else self.prev[i:j], mask
        return out

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        n, k, w = q.shape
        nh = self.nh
        hd, Tb = w // nh, self.ids.shape[1]
        qh = q.view(n, k, nh, hd) * hd ** -0.5  # scaled before the tables' products: V entries, not Tb
        at = self.ids.view(n, 1, 1, Tb).expand(n, nh, k, Tb)
        s = torch.einsum("nkhd,vhd->nhkv", qh, self.kv[:, :w].view(-1, nh, hd)).gather(-1, at)  # [n, nh, k, Tb]
        if self.s is not None:
            before = self.prev.view(n, 1, 1, Tb).expand(n, nh, k, Tb)
            s = s + torch.einsum("nkhd,vhd->nhkv", qh, self.s.view(-1, nh, hd)).gather(-1, before)
        if self.mask is not None:
            s = s.masked_fill(~self.mask.view(n, 1, 1, Tb), float("-inf"))
        p = s.softmax(-1)
        per_id = p.new_zeros(n, nh, k, self.kv.shape[0]).scatter_add_(-1, at, p)  # [n, nh, k, V]
        return torch.einsum("nhkv,vhd->nkhd", per_id, self.kv[:, w:].view(-1, nh, hd)).reshape(n, k, w)


RowRead = EntryRead | IdRead
"""A per-row reader: N rows of one query each, `rows(i, j, mask)` a slice of them."""


def read_rows(bank: SourceBank, kind: str, kept: torch.Tensor, rows: torch.Tensor, Tb: int, n_heads: int,
              tabs: dict[str, torch.Tensor] | None) -> RowRead:
    """The read of `rows`' banks at positions 0..Tb-1 from a decode state's buffer `kept` (its entries `[B, T_max,
    2w]` or ids `[B, T_max]`): `kind` "entries" (kept), "lookup" (entries looked up from the kept ids) or "ids"
    (through the tables, `IdRead`); `tabs`: the bank's tables (None: `bank_tables`). A pure function of tensors, as a
    compiled graph reads it (`BankCache.read`)."""
    if kind == "ids":
        return IdRead(bank, kept.narrow(1, 0, Tb).index_select(0, rows), n_heads, tabs)
    return EntryRead(*kept_entries(bank, kind == "entries", kept, rows, Tb, tabs), n_heads)


def kept_entries(bank: SourceBank, entries: bool, kept: torch.Tensor, rows: torch.Tensor | None, Tb: int,
                 tabs: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[b, Tb, w]` each at positions 0..Tb-1 of `rows` `[b]` (None: every row) of the cache's buffer `kept`:
    its entries (`entries`), or their lookups from its ids (`tables.entries_from_ids`, through `tabs`: None,
    `bank_tables`)."""
    kept = kept.narrow(1, 0, Tb) if rows is None else kept.narrow(1, 0, Tb).index_select(0, rows)
    return (kept if entries else entries_from_ids(bank, kept, tabs)).split(bank.cfg.w, -1)
