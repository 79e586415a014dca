"""Several processes (torchrun): DDP or FSDP2 wrapping, sharding a global batch, reducing statistics, and
gathering full model and optimizer state for a checkpoint. One process runs the same code with a world of 1."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from prisme.training.config import StageConfig

# ------------------------------------------------------------------------------------------------------ distributed


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this call initialised the process group (and destroys it at the end)

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE > 1), or use one that is already initialised."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_available() and dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(local_rank)
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if device.startswith("cuda"):  # before the group: NCCL, FSDP2 and every `.cuda()` use the current device
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, owns_group=True)


def check_layout(scfg: StageConfig, di: DistInfo) -> None:
    """The global batch splits evenly over ranks and accumulation steps (ValueError naming both otherwise)."""
    if scfg.batch_size % (scfg.grad_accum * di.world):
        raise ValueError(f"batch_size={scfg.batch_size} must be divisible by grad_accum x world size = "
                         f"{scfg.grad_accum} x {di.world}")


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on `device`: the GPU's total, or the machine's physical memory for the CPU (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        return None


def check_memory(scfg: StageConfig, cfg: Any, seq_len: int, di: DistInfo, device: torch.device) -> None:
    """Refuse a micro-batch whose activations cannot fit, before anything is allocated: a lower bound, the logits
    and one residual stream per layer kept for backward (4 bytes each), against the device's memory."""
    micro = scfg.batch_size // (scfg.grad_accum * di.world)
    need = micro * seq_len * (cfg.vocab_size + cfg.d_model * (cfg.n_layer + 1)) * 4
    have = device_memory(device)
    if have is not None and need > have:
        raise ValueError(f"batch_size={scfg.batch_size} (a micro-batch of {micro} x seq_len {seq_len}) needs at "
                         f"least {need / 2**30:,.0f} GiB of activations, more than the {have / 2**30:,.0f} GiB of "
                         f"{device.type} memory: lower --batch-size or raise --grad-accum")


def shard_rows(t: torch.Tensor, micro: int, accum: int, di: DistInfo) -> torch.Tensor:
    """Rows of micro-batch `micro` for this rank: [(micro W + rank) b, +b) with b = B / (W accum)."""
    b = t.shape[0] // (accum * di.world)
    start = (micro * di.world + di.rank) * b
    return t[start : start + b]


def _flat(stats: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The statistics (sorted by name) as one float64 vector on `device`; `_unflat` splits it back."""
    return torch.cat([stats[k].detach().to(device=device, dtype=torch.float64).reshape(-1) for k in sorted(stats)])


def _unflat(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for k in sorted(like):
        n = like[k].numel()
        out[k] = flat[i : i + n].view(like[k].shape)
        i += n
    return out


def all_reduce_stats(stats: dict[str, torch.Tensor], di: DistInfo, device: torch.device) -> dict[str, torch.Tensor]:
    """Sum the step's statistics over ranks, in one collective on the training `device` (NCCL takes no CPU tensor)."""
    if di.world == 1:
        return stats
    import torch.distributed as dist

    flat = _flat(stats, device)
    dist.all_reduce(flat)
    return _unflat(flat, stats)


def stats_to_host(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The statistics on the CPU in one device-to-host copy (a `float()` of each would be a host sync apiece)."""
    if not stats or all(v.device.type == "cpu" for v in stats.values()):
        return stats
    return _unflat(_flat(stats, next(iter(stats.values())).device).cpu(), stats)


def any_rank(flag: bool, di: DistInfo, device: torch.device) -> bool:
    """True on every rank if `flag` is set on any (one collective on the training `device`)."""
    if di.world == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t)
    return bool(t.item() > 0)


# ------------------------------------------------------------------------------------------------------------ helpers


def resolve_device(name: str, di: DistInfo, tf32: bool = False) -> torch.device:
    """The training device ("auto": CUDA when there is one; "cuda": this rank's GPU); `tf32` allows TF32 matmuls."""
    if tf32:
        from prisme.devices import set_tf32

        set_tf32(True)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        if name == "cuda":
            name = f"cuda:{di.local_rank}"
    return torch.device(name)


def wrap_for_ranks(objective: nn.Module, scfg: StageConfig, di: DistInfo, device: torch.device) -> nn.Module:
    """DDP or FSDP2 around the objective when there are several processes; only trainable parameters sync."""
    if di.world == 1:
        return objective
    if scfg.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(objective)  # one parameter group; frozen parameters are gathered but get no gradient
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDP registers only parameters with requires_grad; buffers (RoPE and action tables) are constants
    sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else {"broadcast_buffers": False})
    return DDP(objective, device_ids=[device.index] if device.type == "cuda" else None, **sync)


def no_sync_unless_last(wrapped: nn.Module, di: DistInfo, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if di.world == 1 or last:
        if di.world > 1 and hasattr(wrapped, "set_requires_gradient_sync"):
            wrapped.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if hasattr(wrapped, "no_sync"):  # DDP
        return wrapped.no_sync()
    wrapped.set_requires_gradient_sync(False)  # FSDP2
    return contextlib.nullcontext()


def rank_barrier(di: DistInfo) -> None:
    if di.world > 1:
        import torch.distributed as dist

        dist.barrier()


def gather_state(wrapped: nn.Module, opt: torch.optim.Optimizer, scfg: StageConfig,
                  di: DistInfo) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """Full (unsharded) model state dict and optimizer state, on every rank (collectives under FSDP)."""
    if di.world > 1 and scfg.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(wrapped, options=opts)
        osd = get_optimizer_state_dict(wrapped, opt, options=opts)
        return {k.removeprefix("model."): v for k, v in msd.items() if k.startswith("model.")}, \
            {"format": "fqn", "state": osd}
    return None, {"format": "torch", "state": opt.state_dict()}


def restore_optimizer(wrapped: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any], scfg: StageConfig,
                      di: DistInfo, source: Any = "optimizer.pt") -> None:
    """Load a checkpoint's optimizer state (read from `source`, which errors name) into `opt`."""
    try:
        _restore_optimizer(wrapped, opt, saved, scfg, di)
    except (KeyError, RuntimeError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{source} does not fit this run's optimizer ({e}); it comes from another "
                         f"run or stage: restore it, or start from the weights only with init_from") from None


def _restore_optimizer(wrapped: nn.Module, opt: torch.optim.Optimizer, saved: dict[str, Any], scfg: StageConfig,
                       di: DistInfo) -> None:
    fmt = saved.get("format")
    fsdp = di.world > 1 and scfg.parallel == "fsdp"
    if fsdp != (fmt == "fqn"):
        raise ValueError(f"the checkpoint's optimizer state was written {'with' if fmt == 'fqn' else 'without'} FSDP; "
                         f"resume it with the same `parallel` setting")
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(wrapped, opt, saved["state"], options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(saved["state"])
