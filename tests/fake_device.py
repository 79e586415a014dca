"""A fake accelerator for CPU-only machines: tensors that say they live on `fakegpu:0` but hold CPU data.

What it catches, as a GPU would:
  * device mixing: an op that combines a `fakegpu` tensor with a CPU tensor of one or more dimensions raises
    "Expected all tensors to be on the same device" (CPU scalars, 0-dim tensors, are allowed, as CUDA allows them),
    and so does a CPU `torch.Generator` used to draw `fakegpu` numbers;
  * host synchronisations: every read of device data by the host (`.item()`, `bool(t)`, `.tolist()`, `.numpy()`,
    `.cpu()`, ops whose output shape depends on the data, such as `nonzero` or boolean indexing) is counted in
    `FakeDevice.syncs`, with where it happened; uploads (`.to(device)`, blocking or not) in `FakeDevice.uploads`.

It is a tensor subclass (`OnDevice`, wrapping a CPU tensor) plus a dispatch mode for factory functions
(`torch.zeros(..., device=...)`) and a function mode for `.to` / `.cpu` / `.tolist`; the device itself is PyTorch's
PrivateUse1 backend renamed `fakegpu`, with the python device guard PyTorch provides for out-of-tree backends, so
autograd, optimizers and `nn.Module.to` work unchanged. Values are computed by the CPU kernels: results equal the
CPU path's (up to the attention kernel chosen). It is slow (a Python call per op): use tiny models.

    with FakeDevice() as fd:
        model = model.to(fd.device)
        ...
    assert fd.sync_count() <= budget
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

NAME = "fakegpu"


def _register() -> torch.device:
    if torch._C._get_privateuse1_backend_name() != NAME:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
    return torch.device(NAME, 0)


DEVICE = _register()

# ops whose output shape (or a Python value) depends on the data: on an accelerator the host waits for them
_DATA_DEPENDENT = {
    torch.ops.aten._local_scalar_dense.default: "item",
    torch.ops.aten.nonzero.default: "nonzero",
    torch.ops.aten.masked_select.default: "masked_select",
    torch.ops.aten.equal.default: "equal",
    torch.ops.aten.is_nonzero.default: "is_nonzero",
    torch.ops.aten._unique2.default: "unique",
    torch.ops.aten.unique_consecutive.default: "unique_consecutive",
}


def _is_fake(d) -> bool:
    if d is None or isinstance(d, (torch.dtype, torch.Tensor, bool)):
        return False
    try:
        return torch.device(d).type == NAME
    except (RuntimeError, TypeError):
        return False


@dataclass
class FakeDevice:
    """The harness: a context manager; its counters fill while it is active."""

    device: torch.device = DEVICE
    syncs: list[tuple[str, str]] = field(default_factory=list)  # (what, where in prisme)
    uploads: Counter = field(default_factory=Counter)  # "blocking" / "non_blocking" -> count
    _stack: contextlib.ExitStack | None = None

    def __enter__(self) -> FakeDevice:
        global _ACTIVE
        _ACTIVE = self
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_generators())
        self._stack.enter_context(_FactoryMode())
        self._stack.enter_context(_MethodMode())
        self._stack.enter_context(mock.patch.object(torch._C, "_InferenceMode", _NoGradInference))
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        self._stack.close()
        _ACTIVE = None

    def sync(self, what: str) -> None:
        self.syncs.append((what, _caller()))

    def sync_count(self) -> int:
        return len(self.syncs)

    def reset(self) -> None:
        self.syncs.clear()
        self.uploads.clear()

    def report(self) -> str:
        """The syncs grouped by where they happened (for a failing budget's message)."""
        return "\n".join(f"  {n} x {what} at {where}" for (what, where), n in Counter(self.syncs).most_common())


_ACTIVE: FakeDevice | None = None


class _NoGradInference:
    """Stands in for `torch._C._InferenceMode`: a wrapper subclass cannot be an inference tensor (its views fail with
    "Cannot set version_counter"), so on the fake device `torch.inference_mode` behaves as `torch.no_grad`, which is
    what it means for the values computed."""

    def __init__(self, mode: bool = True):
        self.ctx = torch.no_grad() if mode else contextlib.nullcontext()

    def __enter__(self):
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


_CPU_GENERATOR = torch.Generator


class _Generator(torch.Generator):
    """`torch.Generator(device=...)` while the harness is active: a CPU generator that says which device it is for
    (`torch.Generator` has no python backend hook for a device of its own)."""

    def __new__(cls, device=None):
        g = super().__new__(cls)
        g.fake = _is_fake(device)
        return g

    def __init__(self, device=None):
        super().__init__()

    @property
    def device(self) -> torch.device:
        return DEVICE if self.fake else torch.device("cpu")


@contextlib.contextmanager
def _generators():
    torch.Generator = _Generator
    try:
        yield
    finally:
        torch.Generator = _CPU_GENERATOR


def _check_generator(g, on_device: bool, what) -> None:
    fake = getattr(g, "fake", False)
    if isinstance(g, _CPU_GENERATOR) and fake != on_device:
        want, got = (NAME, "cpu") if on_device else ("cpu", NAME)
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{got}' ({what})")


def _caller() -> str:
    """The innermost frame inside the prisme package (what to fix), else the innermost outside torch."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if "/prisme/" in f.filename and "/tests/" not in f.filename:
            return f"{f.filename.rsplit('/prisme/', 1)[1]}:{f.lineno} {f.name}"
    for f in reversed(frames):
        if "/torch/" not in f.filename:
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
    return "?"


def _note_sync(what: str) -> None:
    if _ACTIVE is not None:
        _ACTIVE.sync(what)


class OnDevice(torch.Tensor):
    """A CPU tensor (`.elem`) that reports `fakegpu:0` as its device."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, requires_grad=elem.requires_grad, device=DEVICE)
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def unwrap(t):
            if isinstance(t, OnDevice):
                return t.elem
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type == "cpu":
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{NAME}:0 and cpu! ({func}: a cpu tensor of shape {tuple(t.shape)})")
            return t

        if func in _DATA_DEPENDENT or (func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))):
            _note_sync(_DATA_DEPENDENT.get(func, "boolean index"))
        to_host = func is torch.ops.aten._to_copy.default and "device" in kwargs and not _is_fake(kwargs["device"])
        kw = tree_map(unwrap, kwargs)
        if _is_fake(kw.get("device")):
            kw["device"] = torch.device("cpu")
        out = func(*tree_map(unwrap, args), **kw)
        if to_host:
            _note_sync("copy to host")
            return out
        return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t,
                        out)


class _FactoryMode(TorchDispatchMode):
    """`torch.zeros(..., device="fakegpu")` and friends: made on the CPU, wrapped."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_fake(kwargs.get("device")) and not any(isinstance(a, OnDevice) for a in args):
            return OnDevice(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        return func(*args, **kwargs)


def _upload_index(i):
    if isinstance(i, list) or (isinstance(i, torch.Tensor) and not isinstance(i, OnDevice) and i.dim() > 0):
        if _ACTIVE is not None:
            _ACTIVE.uploads["blocking"] += 1
        with torch._C.DisableTorchFunctionSubclass():
            return OnDevice(torch.as_tensor(i))
    return i


class _MethodMode(TorchFunctionMode):
    """`.to(fakegpu)` uploads (counted, blocking or not); `.tolist()`, `.numpy()`, `.cpu()` read back (counted)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        src = args[0] if args else None
        gen = kwargs.get("generator")  # checked here: below this level generators are fresh python objects
        if isinstance(gen, _CPU_GENERATOR):
            on_device = _is_fake(kwargs.get("device")) or any(isinstance(a, OnDevice) for a in args)
            _check_generator(gen, on_device, name)
        if name in ("tolist", "numpy", "cpu") and isinstance(src, OnDevice):
            _note_sync(name)
            return src.elem.tolist() if name == "tolist" else (src.elem.numpy() if name == "numpy"
                                                                else src.elem.clone())
        if name in ("__getitem__", "__setitem__") and isinstance(src, OnDevice):  # a list or CPU index is uploaded
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            idx = tuple(_upload_index(i) for i in idx)
            return func(src, idx if isinstance(args[1], tuple) else idx[0], *args[2:], **kwargs)
        if name == "new_tensor" and isinstance(src, OnDevice) and not (kwargs.get("device") is not None
                                                                        and not _is_fake(kwargs["device"])):
            data = torch.tensor(args[1], dtype=kwargs.get("dtype") or src.dtype)
            return OnDevice(data).requires_grad_(bool(kwargs.get("requires_grad", False)))
        if name == "to" and isinstance(src, torch.Tensor) and not isinstance(src, OnDevice):
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if _is_fake(device):
                if _ACTIVE is not None:
                    _ACTIVE.uploads["non_blocking" if non_blocking else "blocking"] += 1
                with torch._C.DisableTorchFunctionSubclass():
                    data = src.detach().to(dtype=dtype or src.dtype, copy=True)
                out = OnDevice(data)
                return out.requires_grad_() if src.requires_grad and src.is_leaf else out
        # torch.tensor(..., device=...), torch.arange(...): made on the CPU, wrapped
        if _is_fake(kwargs.get("device")) and name != "_parse_to" and not isinstance(src, OnDevice):
            if name in ("tensor", "as_tensor") and _ACTIVE is not None:  # host data copied to the device
                _ACTIVE.uploads["blocking"] += 1
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return OnDevice(out) if isinstance(out, torch.Tensor) else out
        if name == "to" and isinstance(src, OnDevice):
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if _is_fake(device) and (dtype is None or dtype == src.dtype):
                return src
        return func(*args, **kwargs)
