"""The edges of the long-context surfaces (`study lengths`, `bench long`, `--confirm-of`, `--confirm-seeds`,
`--compile`) and the typed Python options: each unclear input is one error naming the option, field or file, before
any training or timing; where an input changes what was asked, one note says so. Each case is a row of
docs/reliability.md."""

from __future__ import annotations

import pytest
import torch

from prisme.config import PrismeConfig
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel
from prisme.options import ExecutionOptions


# ---------------------------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("target", [-3.0, 0.0, 0.5])
def test_a_target_cost_below_the_backbones_is_refused(target):
    """A target below 1 (the backbone alone costs 1 per token) can never be met: refused naming target_cost."""
    with pytest.raises(ValueError, match=r"target_cost must be a finite number >= 1"):
        Controller(1, target_cost=target)
    assert Controller(1, target_cost=1.0).target_cost == 1.0  # control: the backbone's own cost is a target


def test_an_unknown_compile_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"compile_mode.*bogus-mode"):
        ExecutionOptions(compile_mode="bogus-mode")
    assert ExecutionOptions(compile_mode="reduce-overhead").compile_mode == "reduce-overhead"  # control


def test_a_bank_key_without_a_workspace_is_refused():
    with pytest.raises(ValueError, match=r"bank_key='preceding' configures the workspace's bank, but use_workspace"):
        PrismeConfig.from_name("tiny", bank_key="preceding", use_workspace=False)
    assert not PrismeConfig.from_name("tiny", use_workspace=False).use_workspace  # control: the default key is fine
    assert PrismeConfig.from_name("tiny", bank_key="preceding").bank_key == "preceding"


def test_fill_synthetic_names_a_generator_of_the_wrong_type():
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    state = model.new_decode_state(1)
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator or None, got str"):
        state.fill_synthetic(4, generator="seed")
    state.fill_synthetic(4, generator=torch.Generator().manual_seed(0))  # control: a generator fills
    assert state.lengths == [4]
