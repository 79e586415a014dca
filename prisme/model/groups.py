"""Parameter groups (what each training stage trains): a model declares the group of every top-level module or
parameter it can register (`GROUP_OF`), and `check_parameter_groups` holds the groups to a partition of its
parameters. A top-level name the model does not declare is an error, never a silent member of some group."""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn


class ParameterGroups:
    """Mixin of an `nn.Module` whose class declares `GROUPS` and `GROUP_OF` (top-level name -> group)."""

    GROUPS: tuple[str, ...] = ()
    GROUP_OF: dict[str, str] = {}

    @classmethod
    def group_of(cls, name: str) -> str:
        """A parameter's group by its top-level module (`GROUP_OF`); ValueError for one the class does not declare."""
        top = name.split(".")[0]
        if top not in cls.GROUP_OF:
            raise ValueError(f"parameter {name!r}: its top-level module {top!r} is in no parameter group; declare it "
                             f"in {cls.__name__}.GROUP_OF")
        return cls.GROUP_OF[top]

    def parameter_group(self, group: str) -> list[nn.Parameter]:
        """The parameters of one group (`GROUPS`), in registration order."""
        if group not in self.GROUPS:
            raise ValueError(f"unknown parameter group {group!r}; groups: {self.GROUPS}")
        return [p for n, p in self.named_parameters() if self.group_of(n) == group]

    def check_parameter_groups(self) -> None:
        """ValueError unless `GROUPS` partition the parameters: each one, under every name it has (tied weights
        too), in one declared group, and the groups' sizes adding up to all parameters (as nanochat's optimizer
        setup asserts)."""
        seen: dict[int, tuple[str, str]] = {}  # id -> (first name, its group)
        for n, p in self.named_parameters(remove_duplicate=False):
            first, g = seen.setdefault(id(p), (n, self.group_of(n)))
            if self.group_of(n) != g:
                raise ValueError(f"parameter {n!r} (group {self.group_of(n)!r}) is also {first!r} (group {g!r}): "
                                 f"a parameter belongs to one group")
        sizes = {g: len(self.parameter_group(g)) for g in self.GROUPS}
        total = len(list(self.parameters()))
        if sum(sizes.values()) != total:
            raise ValueError(f"the parameter groups {sizes} do not add up to the model's {total} parameters: "
                             f"{type(self).__name__}.GROUP_OF names a group outside GROUPS {self.GROUPS}")

    def parameter_groups(self) -> Iterator[tuple[str, list[nn.Parameter]]]:
        """(group, its parameters) for every group of `GROUPS`, once they are checked to partition the model."""
        self.check_parameter_groups()
        for g in self.GROUPS:
            yield g, self.parameter_group(g)
