"""Shared input validators: one place that decides what a bool, a finite float or a choice is, and how a bad one is
reported (a `ValueError` naming the field and the value).

`check_fields(obj, where)` validates every field of a config dataclass against its annotation: `bool` fields hold
bools (not 0/1 or "no"), `int` fields ints (not bools), `float` fields finite real numbers (ints allowed), `str`
fields strings, `X | None` also None, `tuple[float, float]` two finite numbers, `dict[...]` dicts. Ranges and
allowed sets are each config's own `validate()`.

Command-line values are read here too: `parse_list` reads every comma-separated option (an empty list or entry is an
error everywhere), `count_option` is the argparse `type` of every count option (a bad count is argparse's error
naming the option, before any work).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Callable, Sequence
from typing import Any

# Token ids on an accelerator are range-checked only when this is set (the check reads them back: one host sync per
# forward, a stall in every decode step). Ids on the CPU are always checked; `generate` checks prompts on the host
# before they are uploaded. Set PRISME_CHECK_DEVICE_VALUES=1 (or assign True) while debugging an index error.
DEVICE_VALUE_CHECKS = os.environ.get("PRISME_CHECK_DEVICE_VALUES", "") not in ("", "0")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite real number (int or float, not bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_number(name: str, v: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 where: str = "") -> float:
    """ValueError unless `v` is a finite number in the range; returns it as a float."""
    rng = ""
    if lo is not None or hi is not None:
        rng = f" in {'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    ok = is_number(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
    if not ok:
        raise ValueError(f"{where}{name} must be a finite number{rng}, got {v!r}")
    return float(v)


COMPILE_SETTINGS = ("off", "auto", "strict")  # `compile` fields and `--compile`: eager, compile where it works, or must


def check_seeds(seeds: Any, where: str = "") -> list[int]:
    """A study's training seeds: a non-empty list of distinct ints >= 0; ValueError naming `seeds`."""
    if not isinstance(seeds, list) or len(seeds) == 0:
        raise ValueError(f"{where}seeds must be a non-empty list, got {seeds!r}")
    if not all(is_int(s) and s >= 0 for s in seeds):
        raise ValueError(f"{where}seeds must be integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}seeds must be distinct, got {seeds!r}")
    return seeds


def check_choice(name: str, v: Any, choices: Sequence[str | None], where: str = "") -> Any:
    if v not in choices:
        raise ValueError(f"{where}{name} must be one of {choices}, got {v!r}")
    return v


def check_price(name: str, value: Any) -> None:
    """A price of a policy (`lambda_cost`, `kappa_risk`): None (the model's default) or a finite number >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (or None for the model's default), got {value!r}")


def check_max_budget(max_budget: Any, r_max: int, use_workspace: bool = True) -> int:
    """A controller budget: an int in [0, r_max], and 0 for a model without a workspace; returns it."""
    if not is_int(max_budget) or max_budget < 0:
        raise ValueError(f"max_budget must be an int >= 0, got {max_budget!r}")
    if max_budget > r_max:
        raise ValueError(f"max_budget={max_budget} exceeds r_max={r_max}")
    if max_budget > 0 and not use_workspace:
        raise ValueError("this model has no workspace (use_workspace=False): max_budget must be 0")
    return max_budget


def _matches(v: Any, ann: str) -> bool:
    ann = ann.replace(" ", "")
    if "|" in ann:
        return any(_matches(v, part) for part in ann.split("|"))
    if ann == "None":
        return v is None
    if ann == "bool":
        return isinstance(v, bool)
    if ann == "int":
        return is_int(v)
    if ann == "float":
        return is_number(v)
    if ann == "str":
        return isinstance(v, str)
    if ann.startswith("dict"):
        return isinstance(v, dict)
    if ann.startswith("list"):
        inner = ann[5:-1]
        return isinstance(v, list) and all(_matches(x, inner) for x in v)
    if ann.startswith("tuple"):
        inner = ann[6:-1].split(",")
        return isinstance(v, (tuple, list)) and len(v) == len(inner) and all(_matches(x, t) for x, t in zip(v, inner))
    return True  # an annotation this checker does not know: the config's validate() decides


_KIND = {"bool": "a bool (true/false)", "int": "an integer", "float": "a finite number", "str": "a string",
         "tuple[float, float]": "two finite numbers [a, b]"}


def check_fields(obj: Any, where: str = "") -> None:
    """ValueError naming the first field of dataclass `obj` whose value does not match its annotation."""
    hints = {f.name: f.type if isinstance(f.type, str) else typing.get_type_hints(type(obj)).get(f.name)
             for f in dataclasses.fields(obj)}
    for name, ann in hints.items():
        ann = str(ann)
        v = getattr(obj, name)
        if not _matches(v, ann):
            kinds = [(_KIND.get(p.strip()) or p.strip()) for p in ann.split("|")]
            want = " or ".join("None" if k == "None" else k for k in kinds)
            raise ValueError(f"{where}{name} must be {want}, got {v!r} ({type(v).__name__})")


def check_utf8(text: str, option: str) -> str:
    """`text` itself when it is valid Unicode; a ValueError naming `option` and the bad byte when it holds the
    surrogate escapes Python puts in place of undecodable bytes (a non-UTF-8 command-line argument)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"code point U+{bad:04X}"
        raise ValueError(f"{option} is not valid UTF-8 text ({byte} at character {e.start}); pass UTF-8 text (or "
                         f"token ids with --prompt-ids)") from None
    return text


# ------------------------------------------------------------------------------------------------ command-line values
def parse_list(text: str, option: str, item: Callable[[str], Any] = str, example: str = "",
               distinct: bool = False) -> list[Any]:
    """A comma-separated option (`--seeds 0,1,2`, `--shapes a,b`): each entry stripped and read by `item` (one of
    `integer`, `number`, `one_of`, or any function raising a ValueError that says what is wrong with the entry). A
    ValueError naming `option` for an empty list or entry (`""`, `"1,,2"`, `"1,"`), an entry `item` refuses, or with
    `distinct` an entry given twice. Every comma-separated option of the command line goes through here."""
    hint = f" (e.g. {option} {example})" if example else ""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError(f"{option} is empty: give a comma-separated list{hint}")
    if not all(parts):
        raise ValueError(f"{option} {text!r} has an empty entry: give a comma-separated list{hint}")
    out = []
    for p in parts:
        try:
            out.append(item(p))
        except ValueError as e:
            raise ValueError(f"{option} {text!r}: {e}{hint}") from None
    if distinct and len(set(out)) != len(out):
        twice = sorted({p for p, v in zip(parts, out) if out.count(v) > 1})
        raise ValueError(f"{option} {text!r} lists {', '.join(twice)} twice: give each entry once")
    return out


def integer(lo: int | None = None) -> Callable[[str], int]:
    """A `parse_list` entry reader: an integer (>= `lo`)."""
    def read(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or lo is not None and v < lo:
            raise ValueError(f"{text!r} is not an integer{'' if lo is None else f' >= {lo}'}")
        return v
    return read


def number(lo: float | None = None) -> Callable[[str], float]:
    """A `parse_list` entry reader: a finite number (>= `lo`)."""
    def read(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or lo is not None and v < lo:
            raise ValueError(f"{text!r} is not a finite number{'' if lo is None else f' >= {lo}'}")
        return v
    return read


def one_of(choices: typing.Iterable[str]) -> Callable[[str], str]:
    """A `parse_list` entry reader: one of `choices`."""
    known = list(choices)

    def read(text: str) -> str:
        if text not in known:
            raise ValueError(f"{text!r} is not one of {', '.join(known)}")
        return text
    return read


def count_option(lo: int = 1) -> Callable[[str], int]:
    """The argparse `type` of a count option: an integer >= `lo`; anything else is argparse's error naming the
    option (`argument --repeats: must be an integer >= 1, got '0'`, exit 2) before any work."""
    def read(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return v
    read.__name__ = f"integer >= {lo}"
    return read
