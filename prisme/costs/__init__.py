"""The analytic cost model (`analytic`: seed 000's terms; `bank`: the source bank's; `traces`: the cost of actual
traces), its tie to the real modules (`counting`: matmul FLOPs counted by `FlopCounterMode`) and the `prisme costs`
table (`table`). docs/costs.md derives every term."""

from __future__ import annotations

from prisme.costs.analytic import (
    ASSUMPTIONS,
    BACKBONE,
    BACKBONE_TERMS,
    COMPONENTS,
    OPTIMISED_ASSUMPTIONS,
    OPTIONAL_COMPONENTS,
    SEED_ASSUMPTIONS,
    SEED_ROWS,
    SLOT_KV_ASSUMPTIONS,
    action_cost_proxy,
    action_editor_ops,
    attended_keys,
    backbone_linear_allowance,
    backbone_ops,
    backbone_params,
    components,
    controller_bank_ops,
    controller_entropy_ops,
    controller_input_ops,
    controller_step_ops,
    copy_head_ops,
    cost_document,
    cost_table,
    key_shift_params,
    readout_ops,
    router_lookup_ops,
    router_match_ops,
    router_ops,
    router_share_of_layer,
    seed_rows,
    token_ops,
    workspace_params,
)
from prisme.costs.bank import (
    bank_lookup_ops,
    bank_ops,
    bank_projection_ops,
    bank_reads,
    bank_shift_ops,
    id_read_attention_ops,
    reads_through_tables,
    tables_read_pays,
)
from prisme.costs.counting import OpsCounter
from prisme.costs.table import costs_cli, format_table
from prisme.costs.traces import TraceCost, trace_cost

__all__ = [
    "COMPONENTS", "BACKBONE", "OPTIONAL_COMPONENTS", "components", "controller_entropy_ops", "controller_bank_ops",
    "copy_head_ops", "controller_input_ops", "SEED_ROWS", "SEED_ASSUMPTIONS", "ASSUMPTIONS", "OPTIMISED_ASSUMPTIONS",
    "SLOT_KV_ASSUMPTIONS", "backbone_params", "backbone_linear_allowance", "workspace_params", "action_editor_ops",
    "controller_step_ops", "readout_ops", "bank_projection_ops", "bank_shift_ops", "bank_ops", "backbone_ops",
    "token_ops", "seed_rows", "action_cost_proxy", "cost_table", "cost_document", "TraceCost", "trace_cost",
    "OpsCounter", "format_table", "costs_cli", "router_ops", "router_lookup_ops", "router_match_ops",
    "router_share_of_layer",
    "BACKBONE_TERMS", "attended_keys", "key_shift_params", "bank_lookup_ops", "bank_reads", "id_read_attention_ops",
    "reads_through_tables", "tables_read_pays",
]
