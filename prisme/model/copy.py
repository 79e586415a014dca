"""The copy head: the next token copied from where the context's exact matches continued, mixed into the model's
distribution by a learned gate.

Notation: B rows, Tq query positions, Tb context positions (j < t), V vocab, d backbone width, cap the longest match
counted (`prisme.model.bank.suffix.MAX_MATCH`), D distance buckets, F gate features, s the stream features.

Keys need no learning: L[t, j] is the common-suffix length of query t and position j (`suffix.match_lengths`; a
decode step updates one row of it, `suffix.step_lengths`), and position j proposes x[j + 1]. The read is a pointer
over the positions that match at least `copy_min_len` tokens,

    a_tj = softmax_j( len[L_tj] + dist[bucket(t - j)] )           (two small tables: no multiply, a lookup each)
    p_copy(b) = sum_j a_tj [x_{j+1} = b]

and its output path a gate on target-free features of the position,

    g_t = sigmoid(MLP([onehot(longest L_t.), entropy(p), max log p, <p, p_copy>, max p_copy, log p(argmax p_copy),
                       the longest match beyond the backbone's window (found, log count), P_s norm(H_t)]))
    p_final = (1 - g_t) p + g_t p_copy

where p is the model's own distribution. A position with no candidate has g = 0 and keeps p. The tables start as a
most-recent-longest-match rule (len = 2 L, dist = 0). `CopyHead.mix` returns log p_final (logits); a position with no
candidate keeps its logits bit for bit (`prisme.model.prisme.PrismeModel.output`).

What the design measured (docs/code.md): an exact copy with one gate per match length (the untrained reference)
takes a 2-layer 64-window model on held-out code 0.14 nats/byte down; the learned pointer and gate another 0.04-0.06.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import COPY_FEATURES, MAX_MATCH, PrismeConfig
from prisme.model.bank.suffix import match_lengths
from prisme.model.outputs import CopyInputs


def copy_inputs(ids: torch.Tensor, pos: torch.Tensor | None = None) -> CopyInputs:
    """`CopyInputs` of the queries at `pos` `[B, Tq]` (default: every position) of the context `ids` `[B, T]`."""
    B, T = ids.shape
    L = match_lengths(ids)  # [B, T, T]
    nxt = F.pad(ids[:, 1:], (0, 1), value=0)  # [B, T]: x[j + 1] (the last position is never a candidate)
    if pos is None:
        return CopyInputs(L, nxt, torch.arange(T, device=ids.device).expand(B, T))
    return CopyInputs(L[torch.arange(B, device=ids.device).unsqueeze(1), pos], nxt, pos)


N_DIST = 11  # distance buckets: floor(log2(t - j)), the last holding 1,024 and beyond
N_FEATURES = COPY_FEATURES  # the gate's features before the stream's (`CopyHead.features`)
LEN_SLOPE = 2.0  # the length table's initial slope (nats per matched token): the longest match dominates
GATE_BIAS = -2.0  # the gate's initial bias: sigmoid(-2) ~ 0.12


def distance_bucket(dist: torch.Tensor) -> torch.Tensor:
    """floor(log2(dist)) for distances >= 1, capped at N_DIST - 1 (long)."""
    return torch.floor(torch.log2(dist.clamp(min=1).to(torch.float32))).long().clamp(max=N_DIST - 1)


class CopyHead(nn.Module):
    """The copy head of `cfg` (module docstring): the pointer's tables, the gate and its stream projection."""

    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.cfg = cfg
        self.min_len = cfg.copy_min_len
        self.window = cfg.attn_window  # matches beyond it are out of the backbone's reach (a gate feature)
        self.len_score = nn.Parameter(LEN_SLOPE * torch.arange(MAX_MATCH + 1.0))  # [cap + 1]
        self.dist_score = nn.Parameter(torch.zeros(N_DIST))  # [D]
        s = cfg.copy_stream
        self.stream = nn.Linear(cfg.d_model, s, bias=False) if s else None
        self.gate_in = nn.Linear(N_FEATURES + s, cfg.copy_hidden)
        self.gate_out = nn.Linear(cfg.copy_hidden, 1)
        nn.init.constant_(self.gate_out.bias, GATE_BIAS)

    # ------------------------------------------------------------------ the pointer
    def pointer(self, L: torch.Tensor, nxt: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p_copy `[B, Tq, V]` and whether a query has a candidate `[B, Tq]`.

        Args:
            L: `[B, Tq, Tb]` common-suffix lengths of each query and context position (0 where j >= t).
            nxt: `[B, Tb]` the token that followed each context position (x[j + 1]; any id where it is not known:
                such a j is never a candidate, j < t).
            pos: `[B, Tq]` each query's absolute position t.
        """
        B, Tq, Tb = L.shape
        cand = L >= self.min_len  # [B, Tq, Tb]
        j = torch.arange(Tb, device=L.device)
        s = self.len_score[L.long()] + self.dist_score[distance_bucket(pos.unsqueeze(-1) - j)]  # [B, Tq, Tb]
        s = s.masked_fill(~cand, float("-inf"))
        has = cand.any(-1)  # [B, Tq]
        a = torch.softmax(s.masked_fill(~has.unsqueeze(-1), 0.0), dim=-1).masked_fill(~cand, 0.0)  # [B, Tq, Tb]
        p = a.new_zeros(B, Tq, self.cfg.vocab_size)
        p.scatter_add_(-1, nxt.unsqueeze(1).expand(B, Tq, Tb), a)  # [B, Tq, V]
        return p, has

    # ------------------------------------------------------------------ the gate
    def features(self, logp: torch.Tensor, p_copy: torch.Tensor, L: torch.Tensor, pos: torch.Tensor,
                 H: torch.Tensor) -> torch.Tensor:
        """The gate's target-free features `[B, Tq, F + s]` (module docstring): the model's log-probabilities logp
        `[B, Tq, V]`, the pointer's p_copy, the lengths L `[B, Tq, Tb]`, positions `[B, Tq]`, the stream H
        `[B, Tq, d]`."""
        V = logp.shape[-1]
        p = logp.exp()
        entropy = -(p * logp).sum(-1, keepdim=True) / math.log(V)  # [B, Tq, 1]
        top = logp.max(-1, keepdim=True).values
        agree = (p * p_copy).sum(-1, keepdim=True)
        pc_max, c = p_copy.max(-1, keepdim=True)
        lp_c = logp.gather(-1, c).clamp(min=-20.0) / 10
        longest = F.one_hot(L.max(-1).values.long(), MAX_MATCH + 1).to(logp.dtype)  # [B, Tq, cap + 1]
        far_len, far_count = self.far_match(L, pos)
        parts = [longest, entropy, top, agree, pc_max, lp_c, (far_len > 0).to(logp.dtype).unsqueeze(-1),
                 torch.log1p(far_count.to(logp.dtype)).unsqueeze(-1), torch.log(agree + 1e-6) / 10]
        if self.stream is not None:
            parts.append(self.stream(F.rms_norm(H, (H.shape[-1],), eps=self.cfg.norm_eps)))
        return torch.cat(parts, -1)

    def far_match(self, L: torch.Tensor, pos: torch.Tensor, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """The longest match of at least n tokens whose n-gram lies beyond the backbone's window (t - j + n > W) and
        how many positions match at that length `[B, Tq]` each (zeros for a backbone that attends to everything)."""
        if self.window is None:
            zero = torch.zeros(L.shape[:2], dtype=torch.long, device=L.device)
            return zero, zero
        j = torch.arange(L.shape[-1], device=L.device)
        beyond = (pos.unsqueeze(-1) - j + n) > self.window  # [B, Tq, Tb]
        Lf = torch.where(beyond, L, torch.zeros_like(L))
        length = Lf.max(-1).values  # [B, Tq]
        length = torch.where(length >= n, length, torch.zeros_like(length))
        count = ((Lf == length.unsqueeze(-1)) & (length.unsqueeze(-1) > 0)).sum(-1)
        return length.long(), count

    def gate(self, feats: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
        """g `[B, Tq]` from the features, 0 where a query has no candidate."""
        g = torch.sigmoid(self.gate_out(F.silu(self.gate_in(feats)))).squeeze(-1)
        return g * has.to(g.dtype)

    # ------------------------------------------------------------------ the mix
    def mix(self, logits: torch.Tensor, inputs: CopyInputs, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p_final `[B, Tq, V]`, g `[B, Tq]`) of queries whose model logits are `logits` `[B, Tq, V]` and whose
        head reads the stream H `[B, Tq, d]`."""
        logp = F.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1)
        p_copy, has = self.pointer(inputs.L, inputs.nxt, inputs.pos)
        g = self.gate(self.features(logp, p_copy, inputs.L, inputs.pos, H.to(logp.dtype)), has).unsqueeze(-1)
        keep = torch.log1p(-g.clamp(max=1 - 1e-6)) + logp
        copy = torch.log(g * p_copy + torch.finfo(logp.dtype).tiny)  # [B, Tq, V]: finite (and no NaN gradient) where
        #   nothing is copied
        mixed = torch.logaddexp(keep, copy).to(logits.dtype)
        return torch.where(has.unsqueeze(-1), mixed, logits), g.squeeze(-1)  # no candidate: the logits, bitwise
