"""The model, top-down: `prisme.PrismeModel` wires a `backbone.Backbone` (with `attention`'s KV cache), the causal
source bank, the slot `workspace`, the `editor`, the value `controller` and the differential `readout`;
`state.DecodeState` decodes with it incrementally; `compiled` holds the torch.compile paths; `outputs` the
dataclasses they pass."""

from __future__ import annotations

from prisme.model.outputs import EncodedContext, PrismeOutput, Rollout, Streams
from prisme.model.prisme import PrismeModel
from prisme.model.state import DecodeState, StepOutput

__all__ = ["DecodeState", "EncodedContext", "PrismeModel", "PrismeOutput", "Rollout", "StepOutput", "Streams"]
