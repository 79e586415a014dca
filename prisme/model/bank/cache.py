"""`BankCache`: what a decode state keeps of the source bank, and how a chunk of new positions is appended.

Notation: B rows, C new positions per row in one call, T_max the state's capacity, w workspace width, d backbone
width.

A cache keeps, per row and position, either the bank's entries (K and V side by side in one buffer `KV`
`[B, T_max, 2w]`, so a step writes each entry once; `K`, `V` are views of it) or, with the decode option
`bank_store="ids"` (`prisme.options.DecodeOptions`: an "embedding" bank served from its tables), the token ids alone
`[B, T_max]`, from which `view` looks the entries up where the workspace runs. Where a key reads the position before
its own (`bank_shift`, `bank_key="preceding"`) it also keeps each bank term's memory of the row's last position
(`prev`: the normed stream `[B, d]`, or the previous id `[B]` of a table term). The router's features read the
token ids (`ids`), which the cache keeps for them too. Only new positions are projected (or looked up): a chunk's
entries are computed once and never again.
"""

from __future__ import annotations

import torch

from prisme.costs.bank import tables_read_pays
from prisme.model.bank.read import RowRead, kept_entries, read_rows
from prisme.model.bank.source import SourceBank
from prisme.model.bank.tables import clear_shift_memory, shift_memory, step_entries
from prisme.model.outputs import Streams
from prisme.options import DecodeOptions

GRAM_TABLE_MAX = 1 << 16  # the most n-gram codes (V^n) per row a cache keeps a table of for the router's cue


class BankCache:
    """A decode state's source bank (see the module docstring).

    Args:
        bank: the model's `SourceBank` (the cache holds a reference to it, not a copy).
        batch_size, max_len: rows B and capacity T_max.
        like: a parameter of the model (the buffers take its dtype and device).
        keep_ids: keep the token ids (the router's features read them); a bank kept as ids keeps them anyway.
        options: how the bank is kept and served (`DecodeOptions`, already checked against the model).
    """

    def __init__(self, bank: SourceBank, batch_size: int, max_len: int, like: torch.Tensor, keep_ids: bool,
                 options: DecodeOptions):
        cfg = bank.cfg
        self.bank, self.cfg, self.options = bank, cfg, options
        entries = options.bank_store == "entries"
        self.KV = like.new_zeros(batch_size, max_len, 2 * cfg.w) if entries else None  # [B, T_max, 2w]
        self.K, self.V = self.KV.split(cfg.w, -1) if entries else (None, None)  # [B, T_max, w] views each
        self.prev = shift_memory(cfg, options, batch_size, like) if entries else []  # ids: the previous id itself
        keep_ids = keep_ids or not entries
        self.ids = torch.zeros(batch_size, max_len, dtype=torch.long, device=like.device) if keep_ids else None
        # the router's n-gram cue from a table of the n-grams each row holds, instead of a scan of its context at
        # every step: grams[b, code] is True iff that n-gram ends at some position n-1..L-2 of row b, for the rows'
        # shared length L = _gram_len (None: to be rebuilt from the ids where the cue is next read)
        n = cfg.router_ngram if cfg.router else 0
        codes = cfg.vocab_size ** n
        self.ngram = n
        self.grams = (torch.zeros(batch_size, codes, dtype=torch.bool, device=like.device)
                      if 0 < n and codes <= GRAM_TABLE_MAX and self.ids is not None else None)
        self._gram_len: int | None = 0

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of the kept entries, the shift memories, the ids and the n-gram table."""
        n = 0 if self.KV is None else self.KV.numel() * self.KV.element_size()
        n += sum(p.numel() * p.element_size() for p in self.prev)
        n += 0 if self.grams is None else self.grams.numel() * self.grams.element_size()
        return n + (0 if self.ids is None else self.ids.numel() * self.ids.element_size())

    def _codes(self, end: int, count: int) -> torch.Tensor:
        """The codes `[B, count]` of the n-grams ending at positions end .. end + count - 1 (each >= n - 1)."""
        n, V = self.ngram, self.cfg.vocab_size
        code = self.ids.narrow(1, end - n + 1, count)
        for m in range(1, n):
            code = code * V + self.ids.narrow(1, end - n + 1 + m, count)
        return code

    def seen_last(self, length: int) -> torch.Tensor | None:
        """The router's n-gram cue (`router.ngram_seen_at`) at the last position of rows that all hold `length`
        positions, `[B, 1]` bool, from the table (rebuilt from the ids first where it is stale); None without one."""
        if self.grams is None:
            return None
        n = self.ngram
        if self._gram_len != length:  # rebuilt: the n-grams ending at n-1 .. length-2
            self.grams.zero_()
            if length - 2 >= n - 1:
                self.grams.scatter_(1, self._codes(n - 1, length - n), True)
            self._gram_len = length
        if length - 1 < n - 1:
            return torch.zeros(self.grams.shape[0], 1, dtype=torch.bool, device=self.grams.device)
        return self.grams.gather(1, self._codes(length - 1, 1))

    def forget_grams(self) -> None:
        """The n-gram table is stale (the rows were rewound or their ids rewritten): rebuilt where next read."""
        self._gram_len = None

    def view(self, Tb: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The bank's keys and values `[b, Tb, w]` each at positions 0..Tb-1 of `rows` `[b]` (None: every row): the
        kept entries, or with `bank_store="ids"` their lookups from the kept ids (`tables.entries_from_ids`)."""
        return kept_entries(self.bank, self.KV is not None, self.kept, rows, Tb, None)

    def read(self, Tb: int, rows: torch.Tensor, n_heads: int) -> RowRead:
        """What the editor reads of `rows`' banks at positions 0..Tb-1 (the "budget1" plan): their keys and
        values (`view`) as an `EntryRead`, or for a bank kept as ids, where it takes fewer ops
        (`prisme.costs.bank.tables_read_pays`: about Tb > 1.5 V), an `IdRead` of their ids (the attention through the
        tables, no entry written)."""
        return read_rows(self.bank, self.read_kind(Tb), self.kept, rows, Tb, n_heads, None)

    def read_kind(self, Tb: int) -> str:
        """How `read` reads a bank of Tb positions: "entries" (kept), "lookup" (entries looked up from the kept ids)
        or "ids" (through the tables, `IdRead`: where `tables_read_pays`)."""
        if self.KV is not None:
            return "entries"
        return "ids" if tables_read_pays(self.bank.cfg, Tb) else "lookup"

    @property
    def kept(self) -> torch.Tensor:
        """What the cache keeps per position: the entries `[B, T_max, 2w]` or the ids `[B, T_max]`."""
        return self.KV if self.KV is not None else self.ids

    def append(self, st: Streams, tokens: torch.Tensor, n_new: list[int], start: list[int],
               start_t: torch.Tensor | None) -> None:
        """Write the bank entries (or ids) of a chunk's new positions.

        Args:
            st: the chunk's streams (H `[B, C, d]` and the source streams), tokens `[B, C]` its ids.
            n_new: real tokens per row (right padding is never written, nor remembered by the shift).
            start: each row's length before the chunk; start_t: the same on the device, or None when every row
                starts at `start[0]` with all C tokens real (then each buffer is written through one slice).
        """
        B, C = tokens.shape
        full = all(n == C for n in n_new)
        dev = tokens.device
        if self.grams is not None:  # one new position per row, aligned, on a table of their length: one insert
            L = start[0]
            if C == 1 and full and start_t is None and self._gram_len == L:
                if L - 1 >= self.ngram - 1:
                    self.grams.scatter_(1, self._codes(L - 1, 1), True)  # the old last position's n-gram
                self._gram_len = L + 1
            else:
                self._gram_len = None
        entries = [(self.ids, tokens)] if self.ids is not None else []  # (buffer, what the new positions write)
        if self.KV is not None:
            # only the new positions are projected (or looked up); hs: what each term's shift memory keeps
            at = self.KV.narrow(1, start[0], C) if start_t is None else None  # written in place where it can be
            KV, hs = step_entries(self.bank, self.options, st, tokens, self.prev or None, at)  # [B, C, 2w]
            entries += [(self.KV, KV)] if at is None else []
            if self.prev and full:  # the shift's memory: each row's last position
                for p, h in zip(self.prev, hs):
                    p.copy_(h[:, -1])  # (copy_ casts)
            elif self.prev:  # ... each row's last real position (padding is never read)
                n_t = torch.tensor(n_new, device=dev)
                moved = (n_t > 0).unsqueeze(1)  # [B, 1]
                last = (n_t - 1).clamp(min=0)  # [B]
                for p, h in zip(self.prev, hs):  # h [B, C, d] (or [B, C] ids)
                    at = last.view(B, 1, *[1] * (h.dim() - 2)).expand(B, 1, *h.shape[2:])
                    p.copy_(torch.where(moved.view(B, *[1] * (p.dim() - 1)), h.gather(1, at).squeeze(1).to(p.dtype),
                                        p))
        if start_t is None:  # every row at the same offset, all full
            for buf, new in entries:
                buf.narrow(1, start[0], C).copy_(new)
            return
        if full:  # rows at different offsets, all full (decoding): no host read
            rows = torch.arange(B, device=dev).repeat_interleave(C)
            cols = torch.arange(C, device=dev).repeat(B)
        else:
            valid = torch.arange(C, device=dev) < torch.tensor(n_new, device=dev)[:, None]
            rows, cols = valid.nonzero(as_tuple=True)  # [N]: real tokens only, padding is never written
        at = cols + start_t[rows]  # their absolute positions
        for buf, new in entries:
            buf[rows, at] = new[rows, cols].to(buf.dtype)

    def forget_shift(self) -> None:
        """The shift memories back to "no previous position" (a state rewound to 0)."""
        clear_shift_memory(self.cfg, self.options, self.prev)

    def reset(self) -> None:
        """Zero every buffer, so stale entries can never leak."""
        if self.KV is not None:
            self.KV.zero_()
        self.forget_shift()
        if self.ids is not None:
            self.ids.zero_()
        if self.grams is not None:
            self.grams.zero_()
            self._gram_len = 0
