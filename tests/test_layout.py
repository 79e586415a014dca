"""The package's layout: each folder is one layer, imports only point down, and no modules import each other in a
circle. Every import counts: module level, inside a function, and under `if TYPE_CHECKING:` (a type-only import
is still a dependency a reader has to follow).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "prisme"
LAYOUT_DOC = PACKAGE.parent / "docs" / "layout.md"  # the layout section the README links

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("prisme.checks", "prisme.devices", "prisme.io", "prisme.stats"),
    ("prisme.config", "prisme.options"),
    ("prisme.costs", "prisme.data"),
    ("prisme.model",),
    ("prisme.checkpoint", "prisme.interop", "prisme.faults", "prisme.rebase", "prisme.hf_full"),
    ("prisme.decoding",),
    ("prisme.training",),
    ("prisme.evaluation",),
    ("prisme.studies",),
    ("prisme.bench",),
    ("prisme.cli", "prisme.own_data_cli", "prisme.__main__", "prisme"),
)
MAX_LINES = 450


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The package modules `path` imports (a `from pkg import sub` names the submodule when `sub` is one)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target == "prisme" or target.startswith("prisme."):
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        out.add(sub if sub in known else target)
            elif isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name == "prisme" or a.name.startswith("prisme."))
            visit(child)

    tree = ast.parse(path.read_text())
    visit(tree)
    out.update(dispatched(tree, known))
    out.discard(name)
    return out


def dispatched(tree: ast.AST, known: dict[str, Path]) -> set[str]:
    """The package modules a module reaches through `importlib.import_module`: the call's string argument, or every
    string value of a module-level dict it looks the name up in (`BENCHES[args.bench]`): hidden imports are edges."""
    tables = {t.id: [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
              for node in getattr(tree, "body", []) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
              for t in node.targets if isinstance(t, ast.Name)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.add(arg.value)
            elif isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name):
                out.update(tables.get(arg.value.id, ()))
    return {m for m in out if m in known}


def layer_of(name: str) -> int:
    """The layer of the longest prefix that names the module (or a package above it)."""
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    if layer is None:
        raise AssertionError(f"module {name} is in no layer of tests/test_layout.py")
    return layer


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(path, name, known) for name, path in known.items()}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, deps in g.items() for b in deps if layer_of(b) > layer_of(a))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_every_import_points_down_a_layer():
    """No module imports one of a higher layer."""
    assert upward_imports(graph(PACKAGE)) == []


def test_no_import_cycles():
    assert cycles(graph(PACKAGE)) == []


def test_no_module_of_the_package_is_over_450_lines():
    long = {name: n for name, p in modules(PACKAGE).items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def readme_layout(readme: Path) -> set[str]:
    """The modules the layout section of `readme` (docs/layout.md) lists, as paths relative to prisme/."""
    import re

    text = readme.read_text()
    start = text.index("## Layout")
    block = text[text.index("```", start) + 3:text.index("```", text.index("```", start) + 3)]
    listed, folders = set(), []  # folders: the open package folders, one per two spaces of indent past the first
    for line in block.splitlines():
        if m := re.match(r"^((?:  )+)(\w+)(/|\.py\b)", line):
            depth = len(m.group(1)) // 2 - 1  # 0: a top-level entry
            folders = folders[:depth]
            if m.group(3) == "/":
                folders.append(m.group(2))
            else:
                listed.add("/".join([*folders, m.group(2) + ".py"]))
    return listed


def test_the_layout_page_lists_every_module():
    """docs/layout.md's layout section names every module of the package (packages' __init__ and __main__ aside)."""
    want = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if p.name != "__main__.py" and (p.name != "__init__.py" or p.parent == PACKAGE)}
    assert readme_layout(LAYOUT_DOC) == want


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "prisme"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__", "corpora", "reference"))
    return dst


def test_negative_control_an_upward_import_is_caught(package_copy: Path):
    """A model module that reaches up into training (inside a function, as lazy imports do) is reported."""
    (package_copy / "model" / "bad.py").write_text(
        "def f():\n    from prisme.training.trainer import train_stage\n    return train_stage\n")
    assert upward_imports(graph(package_copy)) == [
        "prisme.model.bad (layer 3) imports prisme.training.trainer (layer 6)"]


def test_negative_control_a_cycle_is_caught(package_copy: Path):
    """Two modules of one layer that import each other are a cycle, even when one import is deferred."""
    (package_copy / "model" / "ping.py").write_text("from prisme.model import pong\n")
    (package_copy / "model" / "pong.py").write_text("def f():\n    from prisme.model.ping import x\n")
    assert cycles(graph(package_copy)) == [["prisme.model.ping", "prisme.model.pong"]]


def test_negative_control_a_type_only_cycle_is_caught(package_copy: Path):
    """An annotation-only import (under `if TYPE_CHECKING:`) is an edge too: a type-only cycle is a cycle."""
    (package_copy / "model" / "hint.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prisme.model.hinted import X\n")
    (package_copy / "model" / "hinted.py").write_text("from prisme.model import hint\n")
    assert graph(package_copy)["prisme.model.hint"] == {"prisme.model.hinted"}
    assert cycles(graph(package_copy)) == [["prisme.model.hint", "prisme.model.hinted"]]


BANK_NAMES = {"bank_norm", "src_norm", "W_K", "W_V", "W_K_shift", "W_K_more", "W_V_more", "P_more", "W_K_shift_more"}
"""The source bank's module names (`prisme.model.bank.source`; its query projection `P` is left out: the name is
too common to scan for)."""


def bank_names_outside(root: Path) -> list[str]:
    """Where a module outside `model/bank/` names one of the bank's modules (an attribute or a string)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        if p.relative_to(root).parts[:2] == ("model", "bank"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.value if isinstance(node, ast.Constant) else None)
            if name in BANK_NAMES:
                out.append(f"{p.relative_to(root)}:{node.lineno} {name}")
    return out


def test_the_source_bank_has_one_home():
    """Nothing outside `prisme/model/bank/` names the bank's modules: its math, tables and decode cache live there."""
    from prisme.model.bank.source import SourceBank

    assert BANK_NAMES <= set(SourceBank.names())
    assert bank_names_outside(PACKAGE) == []


def test_negative_control_a_bank_module_named_elsewhere_is_caught(package_copy: Path):
    """A decode helper that reaches for a bank projection by name is reported."""
    (package_copy / "model" / "reach.py").write_text("def f(model, h):\n    return model.W_K_shift(h)\n")
    assert bank_names_outside(package_copy) == ["model/reach.py:2 W_K_shift"]


def test_negative_control_a_module_missing_from_the_layout_page_is_caught(tmp_path: Path):
    """Dropping one module's line from docs/layout.md makes the listed set differ from the package's."""
    text = LAYOUT_DOC.read_text()
    lines = text.splitlines(keepends=True)
    drop = next(i for i, line in enumerate(lines) if line.startswith("    oracle.py"))
    (tmp_path / "README.md").write_text("".join(lines[:drop] + lines[drop + 1:]))
    full, cut = readme_layout(LAYOUT_DOC), readme_layout(tmp_path / "README.md")
    assert full - cut == {"model/oracle.py"}


MAX_PARAMETERS = 8


def is_cli(path: Path, root: Path) -> bool:
    """A command-line module (`prisme/cli.py`, `prisme/<package>/cli.py`): argparse glue, exempt from the bound."""
    return path.name == "cli.py" and len(path.relative_to(root).parts) <= 2


def long_signatures(root: Path) -> list[str]:
    """"<path> <function>" for every function outside the CLI that takes more than `MAX_PARAMETERS` parameters
    (self / cls not counted; *args and **kwargs count one each)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        if is_cli(p, root):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                first = (a.posonlyargs + a.args)[:1]
                n -= bool(first and first[0].arg in ("self", "cls"))
                if n > MAX_PARAMETERS:
                    out.append(f"{p.relative_to(root)} {node.name}")
    return out


def test_no_function_outside_the_cli_takes_more_than_8_parameters():
    """Settings that travel together are one options object (`EvalOptions`, `DemoOptions`, `TrainingState`, ...),
    not a long parameter list; the command-line modules, which read the flags into those objects, are exempt."""
    assert long_signatures(PACKAGE) == []


def test_negative_control_a_function_of_9_parameters_is_caught(package_copy: Path):
    """A nine-parameter function is reported (self is not counted, *args and **kwargs are); eight pass, and so does
    a long one in a CLI module."""
    (package_copy / "model" / "wide.py").write_text(
        "def nine(a, b, c, d, e, f, g, h, i):\n    pass\n\n\n"
        "def eight(a, b, c, d, e, f, *args, **kwargs):\n    pass\n\n\n"
        "class K:\n    def method(self, a, b, c, d, e, f, g, *, h, **kw):\n        pass\n")
    (package_copy / "evaluation" / "cli.py").write_text("def flags(a, b, c, d, e, f, g, h, i):\n    pass\n")
    found = long_signatures(package_copy)
    assert found == ["model/wide.py nine", "model/wide.py method"]


# ------------------------------------------------------------------------------- one home for each decode concern
FLAGS = ("compiled", "static_decode", "slot_kv_cache")  # the execution flags (`prisme.options.ExecutionOptions`)
CHOOSER = "model/plans/__init__.py"  # the one place that reads them to choose how a decode runs


def owned_fields(tree: ast.AST) -> set[str]:
    """The fields the classes of a module define (annotated class attributes, `self.x = ...` in their methods)."""
    out: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                out.add(node.attr)
    return out


def flag_reads(root: Path) -> list[str]:
    """Every read of an execution flag (`x.compiled`, `x.static_decode`, `x.slot_kv_cache`) outside the plan chooser
    and the modules of the classes that own them (a module whose class defines the field; the command line's
    `args.<flag>`)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        tree = ast.parse(p.read_text())
        if rel == CHOOSER:
            continue
        owned = owned_fields(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in FLAGS and isinstance(node.ctx, ast.Load):
                base = node.value.id if isinstance(node.value, ast.Name) else None
                if base != "args" and node.attr not in owned:
                    out.append(f"{rel}:{node.lineno} .{node.attr}")
    return out


def test_the_execution_flags_are_read_by_the_plan_chooser_and_their_owners_only():
    """How a decode runs is chosen in one place (`prisme.model.plans.choose`); every other module receives a plan or
    an `EditorRun`, never a flag to test (0 reads outside the chooser and the flags' owners)."""
    assert flag_reads(PACKAGE) == []


def test_negative_control_a_flag_read_outside_the_chooser_is_caught(package_copy: Path):
    (package_copy / "decoding" / "peek.py").write_text("def f(model):\n    return model.editor.run.compiled\n")
    assert flag_reads(package_copy) == ["decoding/peek.py:2 .compiled"]


def class_homes(root: Path) -> dict[str, list[str]]:
    """Class names defined in more than one module -> those modules."""
    homes: dict[str, list[str]] = {}
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(str(p.relative_to(root)))
    return {k: v for k, v in homes.items() if len(v) > 1}


def test_no_class_name_is_defined_in_two_modules():
    """One name, one meaning: evaluation's rows are `BackboneRows`, `ControllerRows`, ... beside the model's
    `Backbone` and its policy `Controller`."""
    assert class_homes(PACKAGE) == {}


def test_negative_control_a_second_class_of_a_name_is_caught(package_copy: Path):
    (package_copy / "evaluation" / "rows.py").write_text("class Controller:\n    pass\n")
    assert class_homes(package_copy) == {"Controller": ["evaluation/rows.py", "model/policy.py"]}


def loose_tuples(root: Path) -> list[str]:
    """Parameters annotated `tuple[Any, ...]` (arguments that travel as an untyped bundle)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    if a.annotation is not None and ast.unparse(a.annotation).replace(" ", "") == "tuple[Any,...]":
                        out.append(f"{p.relative_to(root)} {node.name}({a.arg})")
    return out


def test_no_parameter_is_an_untyped_tuple():
    assert loose_tuples(PACKAGE) == []


def test_negative_control_an_untyped_tuple_parameter_is_caught(package_copy: Path):
    (package_copy / "model" / "loose.py").write_text(
        "from typing import Any\n\n\ndef f(parts: tuple[Any, ...]) -> None:\n    pass\n")
    assert loose_tuples(package_copy) == ["model/loose.py f(parts)"]


TIMERS = ("perf_counter", "perf_counter_ns", "Stopwatch")


def clocked(node: ast.AST) -> bool:
    """Whether `node` reads a clock."""
    return any(isinstance(c, ast.Call) and ast.unparse(c.func).split(".")[-1] in TIMERS for c in ast.walk(node))


def sampled(node: ast.AST) -> bool:
    """A timing sample kept: `xs.append(...)` of a difference or a clock reading."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
            and any(isinstance(a, ast.BinOp) and isinstance(a.op, ast.Sub) or clocked(a)
                    for arg in node.args for a in ast.walk(arg)))


def timing_loops(root: Path) -> list[str]:
    """Hand-written rotated timing loops: a `for` loop (over repeats) holding another (over paths) that reads a clock
    and keeps its samples, outside `prisme/devices.py`, the one loop every benchmark and study times with
    (`time_paths`)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        if p.relative_to(root).as_posix() == "devices.py":
            continue
        for outer in ast.walk(ast.parse(p.read_text())):
            if not isinstance(outer, ast.For):
                continue
            inner = [n for n in ast.walk(outer) if isinstance(n, ast.For) and n is not outer]
            if any(clocked(n) and any(sampled(c) for c in ast.walk(n)) for n in inner):
                out.append(f"{p.relative_to(root)}:{outer.lineno}")
    return out


def test_timing_loops_are_the_harness_s():
    assert timing_loops(PACKAGE) == []


def test_negative_control_a_hand_written_timing_loop_is_caught(package_copy: Path):
    (package_copy / "bench" / "mine.py").write_text(
        "import time\n\n\ndef f(paths, repeats, ms):\n    for _ in range(repeats):\n        for run in paths:\n"
        "            t0 = time.perf_counter()\n            run()\n            ms.append(time.perf_counter() - t0)\n")
    assert timing_loops(package_copy) == ["bench/mine.py:5"]


def test_negative_control_an_importlib_dispatch_that_imports_back_is_a_cycle(package_copy: Path):
    """A module that reaches another through `importlib.import_module` (directly or from a dict of names) and is
    imported back by it is a cycle, as if it imported it."""
    (package_copy / "bench" / "hub.py").write_text(
        "import importlib\n\nTABLE = {'x': 'prisme.bench.spoke'}\n\n\ndef run(k):\n"
        "    return importlib.import_module(TABLE[k])\n")
    (package_copy / "bench" / "spoke.py").write_text("def f():\n    from prisme.bench.hub import TABLE\n")
    assert ["prisme.bench.hub", "prisme.bench.spoke"] in cycles(graph(package_copy))


def test_the_editor_keeps_its_math_in_under_350_lines():
    assert len((PACKAGE / "model" / "editor.py").read_text().splitlines()) < 350
