"""Shared test fixtures: a tiny config, per-test seeding, an `assert_close` that prints the max diff, and the `gpu`
marker's auto-skip when CUDA is absent (`slow` and `gpu` tests are deselected by default, see pyproject.toml)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from prisme.config import PrismeConfig

SEED = 1234


def assert_close(a: torch.Tensor | float, b: torch.Tensor | float, atol: float, msg: str = "") -> float:
    """Assert max |a - b| <= atol (shapes must match); the failure names the max diff and where it is.

    Returns the max diff, so a test can also check that a difference is large (negative controls).
    """
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    assert a.shape == b.shape, f"{msg}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a.double() - b.double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    where = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape)) if diff.numel() else ()
    assert worst <= atol, f"{msg}: max |diff| = {worst:.3e} > atol {atol:.1e} at index {where}"
    return worst


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread: the tiny models here are faster on one, and results don't depend on the core count."""
    torch.set_num_threads(1)


@pytest.fixture
def tiny_cfg() -> PrismeConfig:
    """The `tiny` preset (llama-style, with a workspace): every code path in milliseconds."""
    return PrismeConfig.from_name("tiny")


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Every test starts from the same RNG state, whatever ran before it."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
