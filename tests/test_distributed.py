"""Scale-out: 2 processes (gloo, rendezvous through a file) and gradient accumulation reproduce a 1-process run on
the same global batch, in float64 (tolerance 1e-10 on every weight after 3 AdamW steps; only the summation order
differs). torchrun itself (env:// on 127.0.0.1) runs the same code path: `setup_distributed` joins its group."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from prisme import checkpoint as ckpt
from prisme.config import PrismeConfig
from prisme.data.text import TokenDataset
from prisme.training import trainer as train_mod
from prisme.training.config import StageConfig
from prisme.training.trainer import train_stage

TOL = 1e-10  # float64, 3 steps: the two runs differ only in the order of the gradient sums



def _data() -> TokenDataset:
    g = torch.Generator().manual_seed(0)
    return TokenDataset(torch.randint(0, 64, (4000,), generator=g), val_fraction=0.25, vocab_size=64)


def _cfg(out: Path, stage: str, init_from: Path | None = None, **kw) -> StageConfig:
    base = dict(stage=stage, steps=3, batch_size=8, seq_len=16, lr=1e-2, warmup=1, eval_every=0, eval_batches=1,
                out_dir=str(out), init_from=None if init_from is None else str(init_from), progress=False,
                dtype="float64", seed=5, oracle_positions=4, max_budget=2)
    base.update(kw)
    return StageConfig(**base)


def _worker(rank: int, world: int, store: str, jobs: list[tuple[dict, dict | None, bool]]) -> None:
    """One process of a torchrun-like job: join the gloo group, train each (stage config, model config, broken)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world))
    # rendezvous through a file: no port to pick (a free port can be taken by another process before we bind it)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    shard = train_mod.shard_rows
    try:
        for scfg_dict, model_cfg, broken in jobs:
            # negative control: with `broken`, every rank trains on rank 0's rows (a sharding bug)
            train_mod.shard_rows = ((lambda t, m, a, di: shard(t, m, a, train_mod.DistInfo(0, di.world))) if broken
                                else shard)
            train_stage(None if model_cfg is None else PrismeConfig.from_dict(model_cfg),
                        StageConfig.from_dict(scfg_dict), dataset=_data())
    finally:
        train_mod.shard_rows = shard
        dist.barrier()  # every rank done before rank 0's store goes away
        dist.destroy_process_group()


def _spawn(*jobs: tuple[StageConfig, PrismeConfig | None, bool], world: int = 2) -> None:
    """Run the jobs one after the other in `world` fresh processes (one spawn: the imports are paid once)."""
    args = [(s.to_dict(), None if m is None else m.to_dict(), broken) for s, m, broken in jobs]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, str(Path(d) / "store"), args), nprocs=world, join=True)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_model(run)[0].state_dict()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory) -> Path:
    """A stage-1 checkpoint (single process) that the workspace runs start from."""
    out = tmp_path_factory.mktemp("dist") / "backbone"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    train_stage(PrismeConfig.from_name("tiny"), _cfg(out, "backbone"), dataset=_data())
    torch.set_num_threads(n)
    return out


def test_grad_accumulation_matches_the_full_batch(tmp_path, stage1):
    """grad_accum=2 (two half micro-batches) gives the weights of one full-batch step, to 1e-10 in float64."""
    train_stage(None, _cfg(tmp_path / "full", "workspace", stage1), dataset=_data())
    train_stage(None, _cfg(tmp_path / "accum", "workspace", stage1, grad_accum=2), dataset=_data())
    full, acc = _weights(tmp_path / "full"), _weights(tmp_path / "accum")
    assert _max_diff(full, acc) <= TOL
    assert _max_diff(full, _weights(stage1)) > 1e-3  # the workspace did move


def test_ddp_two_processes_match_one_process_with_a_frozen_backbone(tmp_path, stage1):
    """2 DDP processes (gloo) on the workspace stage, backbone frozen, end within 1e-10 of 1 process; a sharding
    bug (both ranks on the same rows) is caught."""
    single = tmp_path / "single"
    train_stage(None, _cfg(single, "workspace", stage1), dataset=_data())
    _spawn((_cfg(tmp_path / "ddp", "workspace", stage1), None, False),
           (_cfg(tmp_path / "broken", "workspace", stage1), None, True))
    a, b = _weights(single), _weights(tmp_path / "ddp")
    assert _max_diff(a, b) <= TOL
    assert all(torch.equal(a[k], _weights(stage1)[k]) for k in a if k.startswith("backbone."))
    assert _max_diff(a, _weights(tmp_path / "broken")) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["backbone", "controller"])
def test_ddp_matches_one_process_on_other_stages(tmp_path, stage1, stage):
    """The backbone and controller stages under 2 DDP processes match 1 process (the controller from stage 2)."""
    model_cfg = PrismeConfig.from_name("tiny") if stage == "backbone" else None
    init = None
    if stage == "controller":
        init = tmp_path / "ws"
        train_stage(None, _cfg(init, "workspace", stage1), dataset=_data())
    train_stage(model_cfg, _cfg(tmp_path / "single", stage, init), dataset=_data())
    _spawn((_cfg(tmp_path / "ddp", stage, init), model_cfg, False))
    assert _max_diff(_weights(tmp_path / "single"), _weights(tmp_path / "ddp")) <= TOL


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process_and_resume(tmp_path, stage1):
    """FSDP2 (fully_shard) with 2 processes matches 1 process on the workspace stage, and resumes exactly from a
    mid-run checkpoint."""
    train_stage(None, _cfg(tmp_path / "single", "workspace", stage1, steps=5), dataset=_data())
    _spawn((_cfg(tmp_path / "fsdp", "workspace", stage1, steps=5, parallel="fsdp", ckpt_every=3, keep_last=0), None,
            False))
    single = _weights(tmp_path / "single")
    assert _max_diff(single, _weights(tmp_path / "fsdp")) <= TOL
    # resume: the same run cut back to its step-3 checkpoint, continued to step 5 under FSDP
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "fsdp", cut)
    shutil.rmtree(cut / "ckpt_000005")
    (cut / ckpt.LATEST).write_text("ckpt_000003\n")
    _spawn((_cfg(cut, "workspace", stage1, steps=5, parallel="fsdp", resume=True), None, False))
    assert ckpt.read_meta(cut).step == 5
    assert _max_diff(single, _weights(cut)) <= TOL
