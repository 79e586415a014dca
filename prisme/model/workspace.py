"""Workspace bookkeeping: action ids, their slots, slot initialisation and STOP semantics. Pure functions.

Action ids (SPEC §3), with M slots and A = M + M/2:
  * 0 .. M-1        edit slot i                       (k = 1)
  * M .. A-1        edit the pair (2j, 2j+1), j = a - M  (k = 2)
  * A   = STOP      absorbing: once a position stops, every later step is STOP
  * A+1 = DENSE     edit all M slots (forced runs only: the dense baseline; the controller never picks it)
Actions may repeat.
"""

from __future__ import annotations

import torch

from prisme.config import PrismeConfig
from prisme.model.backbone import check_tokens


def action_table(cfg: PrismeConfig) -> torch.Tensor:
    """`[A, 2]` slot ids of each controller action; the second entry is -1 for single-slot actions."""
    M = cfg.n_slots
    singles = torch.stack([torch.arange(M), torch.full((M,), -1)], dim=1)  # [M, 2]
    pairs = torch.arange(M).view(M // 2, 2)  # [M/2, 2]
    return torch.cat([singles, pairs]).long()


def action_group_size(cfg: PrismeConfig) -> torch.Tensor:
    """`[A]` number of slots each controller action edits (1 or 2)."""
    return (action_table(cfg) >= 0).sum(dim=1)


def action_groups(cfg: PrismeConfig) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Every action id by group: singles (k=1), pairs (k=2), DENSE (k=M).

    Returns (group `[A+2]`: 0, 1 or 2, and -1 for STOP; slots `[A+2, M]`: the action's slots, -1 padded;
    sizes: the k of each group).
    """
    A, M = cfg.n_actions, cfg.n_slots
    table, size = action_table(cfg), action_group_size(cfg)
    group = torch.full((A + 2,), -1, dtype=torch.long)
    slots = torch.full((A + 2, M), -1, dtype=torch.long)
    group[:A] = size - 1
    slots[:A, :2] = table
    group[cfg.dense_action] = 2
    slots[cfg.dense_action] = torch.arange(M)
    return group, slots, (1, 2, M)


def group_first_actions(cfg: PrismeConfig) -> tuple[int, int, int]:
    """The first action id of each group of `action_groups`: singles (0), pairs (M), DENSE (A + 1)."""
    return 0, cfg.n_slots, cfg.dense_action


def slots_of_action(cfg: PrismeConfig, action: int) -> list[int]:
    """The slots an action id edits ([] for STOP)."""
    if action == cfg.stop_action:
        return []
    if action == cfg.dense_action:
        return list(range(cfg.n_slots))
    return [int(s) for s in action_table(cfg)[action] if s >= 0]


def init_workspace(slot_embed: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """S0 `[..., M, w]` = slot_embed `[M, w]` + z `[..., w]` broadcast over slots."""
    return slot_embed + z.unsqueeze(-2)


def absorb_stop(actions: torch.Tensor, stop: int) -> torch.Tensor:
    """`[..., R]` actions with every step after the first STOP also STOP."""
    stopped = torch.cumsum((actions == stop).long(), dim=-1) > 0
    return torch.where(stopped, torch.full_like(actions, stop), actions)


def check_actions(actions: torch.Tensor, cfg: PrismeConfig, allow_dense: bool = True) -> None:
    """ValueError unless `actions` is an integer tensor of ids in [0, A] (or [0, A+1] with DENSE)."""
    if not isinstance(actions, torch.Tensor) or actions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"actions must be an integer torch.Tensor, got {getattr(actions, 'dtype', type(actions))}")
    if actions.numel() == 0:
        return
    hi = cfg.dense_action if allow_dense else cfg.stop_action
    lo_v, hi_v = int(actions.min()), int(actions.max())
    if lo_v < 0 or hi_v > hi:
        what = "[0, A+1] (A+1 = DENSE)" if allow_dense else "[0, A] (DENSE is for forced runs only)"
        raise ValueError(f"action ids must lie in {what} with A={cfg.n_actions}; got min {lo_v}, max {hi_v}")


def slot_counts(cfg: PrismeConfig) -> torch.Tensor:
    """`[A+2, M]` how many times each action id edits each slot (0/1)."""
    _, slots, _ = action_groups(cfg)
    counts = torch.zeros(cfg.dense_action + 1, cfg.n_slots, dtype=torch.long)
    return counts.scatter_add_(1, slots.clamp(min=0), (slots >= 0).long())


def bank_mask(B: int, Tq: int, Tb: int, query_pos: torch.Tensor | None = None, bank_len: torch.Tensor | None = None,
              device: torch.device | None = None) -> torch.Tensor:
    """`[B, Tq, Tb]` bool: key j is readable by the query at position p iff j <= p (and j < bank_len)."""
    if query_pos is None:
        query_pos = torch.arange(Tq, device=device).view(1, Tq).expand(B, Tq)
    keys = torch.arange(Tb, device=device).view(1, 1, Tb)
    mask = keys <= query_pos.unsqueeze(-1)
    if bank_len is not None:
        mask = mask & (keys < bank_len.view(B, 1, 1))
    return mask


def check_forced(cfg: PrismeConfig, tokens: torch.Tensor, actions: torch.Tensor,
                 budget: int | torch.Tensor | None) -> torch.Tensor:
    """Forced actions `[B, T, R]` for `tokens` `[B, T]`: valid ids, R <= r_max, each position's budget (int or
    `[B, T]`, default R) in [1, r_max] and no action at a step >= its budget; returns the budget `[B, T]` (long)."""
    check_tokens(tokens, cfg.vocab_size)
    check_actions(actions, cfg, allow_dense=True)
    if actions.dim() != 3 or actions.shape[:2] != tokens.shape:
        raise ValueError(f"actions must have shape [B, T, R] = [{tokens.shape[0]}, {tokens.shape[1]}, R], "
                         f"got {tuple(actions.shape)}")
    R = actions.shape[-1]
    if R > cfg.r_max:
        raise ValueError(f"{R} forced steps exceed the hard cap r_max={cfg.r_max}")
    if budget is None:
        budget = R
    if not torch.is_tensor(budget):
        budget = torch.full(tokens.shape, int(budget), dtype=torch.long, device=tokens.device)
    if budget.shape != tokens.shape:
        raise ValueError(f"budget must be an int or a [B, T] tensor, got shape {tuple(budget.shape)}")
    if int(budget.min()) < 1 or int(budget.max()) > cfg.r_max:
        raise ValueError(f"budget must lie in [1, r_max={cfg.r_max}], got [{int(budget.min())}, "
                         f"{int(budget.max())}]")
    steps = torch.arange(R, device=tokens.device)
    late = (absorb_stop(actions, cfg.stop_action) != cfg.stop_action) & (steps >= budget.unsqueeze(-1))
    if bool(late.any()):
        raise ValueError("a forced action is scheduled at a step >= its position's budget")
    return budget.long()


def check_cost(cost: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    """A price vector `[A]` of finite real numbers >= 0 (None: `default`, the model's `action_cost`), on `default`'s
    device and dtype. A NaN, infinite or negative price would silently make every position STOP (or edit at any cost):
    a ValueError naming `cost`."""
    if cost is None:
        return default
    if isinstance(cost, (str, bytes)) or not (torch.is_tensor(cost) or isinstance(cost, (list, tuple))
                                              or hasattr(cost, "__array__")):
        raise ValueError(f"cost must be a tensor or sequence of {default.shape[0]} prices, got "
                         f"{type(cost).__name__}")
    try:
        raw = torch.as_tensor(cost)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"cost must be a tensor or sequence of {default.shape[0]} numbers: {e}") from None
    if raw.dtype == torch.bool or raw.is_complex():
        raise ValueError(f"cost must hold real numbers, got dtype {raw.dtype}")
    if raw.shape != (default.shape[0],):
        raise ValueError(f"cost must have shape [A] = [{default.shape[0]}], got {tuple(raw.shape)}")
    cost = raw.to(dtype=default.dtype, device=default.device)
    if not bool(torch.isfinite(cost).all()) or bool((cost < 0).any()):
        raise ValueError(f"cost must hold finite prices >= 0, got {raw.tolist()}")
    return cost
