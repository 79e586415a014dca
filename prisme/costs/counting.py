"""The cost model's tie to the real modules: `OpsCounter` counts the matmul FLOPs that
`torch.utils.flop_counter.FlopCounterMode` sees in a forward, per component (tagged by module), with a formula for
CPU attention kernels the plain counter cannot see. tests/test_costs.py checks every analytic term against it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prisme.costs.analytic import COMPONENTS, components


# ---------------------------------------------------------------------- measured ops (the tie to the modules)
def _sdpa_cpu_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """CPU SDPA kernel: QK^T and AV over every (query, key) pair, 2 ops per multiply-add (as torch's own SDPA
    formulas; masks do not reduce the count). query `[B, h, Lq, e]`, key `[B, h_kv, Lk, e]`, value `[..., ev]`."""
    B, h, Lq, e = query.shape
    Lk, ev = key.shape[-2], value.shape[-1]
    return 2 * B * h * Lq * Lk * (e + ev)


class OpsCounter:
    """Matmul ops a `PrismeModel` actually runs, attributed to the cost model's components.

    Counts with `torch.utils.flop_counter.FlopCounterMode` (mm/addmm/bmm/... at 2 ops per multiply-add), adding a
    formula for `aten._scaled_dot_product_flash_attention_for_cpu`, which FlopCounterMode counts as 0. Each op goes to
    the component of the innermost tagged module running it: backbone blocks -> `backbone_linear` (their SDPA ->
    `backbone_attention`, the key shift's `wk_shift` -> `backbone_key_shift`); `backbone.logits` (the head's matmul)
    -> `lm_head`; the bank's projections by their component (`SourceBank.components`), P_ctrl ->
    `controller_input`; the router -> `router`; editor linears by the leaf whose weight they multiply (src_q/src_o,
    slot_q/slot_kv/slot_o, w13/w2, gate: the editor applies them in functional form); an SDPA inside the bank
    reader's `bank_attend` (model/bank/read.py) -> `editor_source_attn` (the causal bank, with or without a mask; so
    do the products of an `IdRead`, the bank kept as ids read through its tables), any other inside an editor block
    -> `editor_slot_attn` (the M slots); controller; readout. Anything else lands in `untagged`. Not counted, by the
    convention: norms, softmax, activations, embeddings, biases.
    Made for CPU runs: on CUDA torch's own SDPA formulas apply.

        with OpsCounter(model) as oc:
            ...  # forward work (no backward)
        oc.by_component  # {component: ops}
    """

    _EDITOR_LEAVES = {"src_q": "editor_source_attn", "src_o": "editor_source_attn", "slot_q": "editor_slot_attn",
                      "slot_kv": "editor_slot_attn", "slot_o": "editor_slot_attn", "w13": "editor_ffn",
                      "w2": "editor_ffn", "gate": "editor_gate"}

    def __init__(self, model: Any):
        self.model = model
        cfg = getattr(model, "cfg", None)
        comps = components(cfg) if cfg is not None else COMPONENTS
        self.by_component: dict[str, int] = dict.fromkeys((*comps, "untagged"), 0)
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._mode: Any = None
        self._leaf_of: dict[int, str] = {}  # an editor leaf's weight (its data pointer) -> its component

    @property
    def total(self) -> int:
        return sum(self.by_component.values())

    def _tags(self) -> dict[Any, str]:
        m, tags = self.model, {}
        backbone = getattr(m, "backbone", m)
        for blk in backbone.blocks:
            tags[blk] = "backbone_block"
            if getattr(blk.attn, "wk_shift", None) is not None:
                tags[blk.attn.wk_shift] = "backbone_key_shift"
                self._leaf_of[blk.attn.wk_shift.weight.data_ptr()] = "backbone_key_shift"  # (a decode step runs it
                #   in functional form: `CausalSelfAttention.one_token`)
        if getattr(backbone, "lm_head", None) is not None:
            tags[backbone.lm_head] = "lm_head"
        if getattr(m, "editor", None) is not None:
            leaves = m.bank.components()  # the bank's projections, by component
            if m._modules.get("P_ctrl") is not None:
                leaves[m.P_ctrl] = "controller_input"
            for lin, comp in leaves.items():
                tags[lin] = comp
                self._leaf_of[lin.weight.data_ptr()] = comp  # (the bank runs them in functional form too)
            for blk in m.editor.blocks:
                tags[blk] = "editor_block"
                for name, comp in self._EDITOR_LEAVES.items():
                    self._leaf_of[getattr(blk, name).weight.data_ptr()] = comp
            tags[m.controller] = "controller"
            if getattr(m.controller, "bank_match", None) is not None:
                tags[m.controller.bank_match] = "controller_bank"
            if getattr(m.controller, "entropy", None) is not None:
                tags[m.controller.entropy] = "controller_entropy"
            tags[m.readout] = "readout"
            if getattr(m, "router", None) is not None:
                tags[m.router] = "router"
        return tags

    def _add(self, packet: Any, ops: int, args: Sequence[torch.Tensor | object], kwargs: dict[str, Any]) -> None:
        tag = self._stack[-1] if self._stack else "untagged"
        sdpa = "scaled_dot_product" in str(packet)
        leaf = next((self._leaf_of[a.data_ptr()] for a in args if isinstance(a, torch.Tensor)
                     and a.data_ptr() in self._leaf_of), None)  # an editor leaf (run in functional form) by its weight
        if leaf is not None:
            tag = leaf
        elif tag == "backbone_block":
            tag = "backbone_attention" if sdpa else "backbone_linear"
        elif tag == "editor_bank":
            tag = "editor_source_attn" if sdpa else "untagged"
        elif tag == "editor_block":
            tag = "editor_slot_attn" if sdpa else "untagged"
        self.by_component[tag] += int(ops)

    def _tagged(self, fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(tag)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()

        return run

    def _wrap(self, packet: Any, formula: Callable[..., int]) -> Callable[..., int]:
        def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            ops = formula(*args, out_val=out_val, **kwargs)
            self._add(packet, ops, args, kwargs)
            return ops

        counted._get_raw = True  # FlopCounterMode passes tensors; `formula` is already shape-wrapped or raw
        return counted

    def __enter__(self) -> OpsCounter:
        from torch.utils.flop_counter import FlopCounterMode, flop_registry

        registry = {**flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops}
        mapping = {p: self._wrap(p, f) for p, f in registry.items()}

        def enter(module: Any, args: Any) -> None:
            self._stack.append(tags[module])

        def leave(module: Any, args: Any, output: Any) -> None:
            self._stack.pop()

        tags = self._tags()
        for mod in tags:
            self._handles.append(mod.register_forward_pre_hook(enter))
            self._handles.append(mod.register_forward_hook(leave))
        backbone = getattr(self.model, "backbone", self.model)
        logits = backbone.logits  # `head(H)` is `logits(final_norm(H))`: the head's matmul is in `logits`

        def tagged_head(h: Any) -> Any:  # the head inside the controller's entropy feature is that feature's cost
            self._stack.append("controller_entropy" if self._stack[-1:] == ["controller_entropy"] else "lm_head")
            try:
                return logits(h)
            finally:
                self._stack.pop()

        backbone.logits = tagged_head  # instance attribute, removed on exit
        self._backbone = backbone
        read = self._read_module = sys.modules.get("prisme.model.bank.read") if getattr(
            self.model, "editor", None) is not None else None  # (loaded with the model: costs sit below the model)
        attend = self._bank_attend = getattr(read, "bank_attend", None)
        if attend is not None:  # the editor's cross-attention to the bank, restored on exit
            read.bank_attend = self._tagged(attend, "editor_bank")
        self._id_read = getattr(read, "IdRead", None)
        if self._id_read is not None:  # the same attention read through the tables: its products, restored on exit
            self._id_read_attend = self._id_read.__dict__["attend"]
            self._id_read.attend = self._tagged(self._id_read_attend, "editor_source_attn")
        self._methods = []  # what a decode step calls as a method, not through the module (no hook runs)
        for obj, name, tag in ((getattr(self.model, "router", None), "scores", "router"),
                               (getattr(self.model, "readout", None), "edited", "readout")):
            if obj is not None:
                self._methods.append((obj, name))
                setattr(obj, name, self._tagged(getattr(obj, name), tag))  # instance attribute, removed on exit
        self._mode = FlopCounterMode(display=False, custom_mapping=mapping)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        del self._backbone.logits
        for obj, name in self._methods:
            delattr(obj, name)
        if self._bank_attend is not None:
            self._read_module.bank_attend = self._bank_attend
        if self._id_read is not None:
            self._id_read.attend = self._id_read_attend
