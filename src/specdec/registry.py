"""Named plug-ins of one kind (backends, drafters, tool-call parsers), each in its own module.

A module registers its factory with `@REGISTRY.register("name")`; the built-in modules are
imported on the first lookup, so adding one is its file plus its name in `builtins`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from specdec.errors import SpecdecError

T = TypeVar("T")


class Registry(dict[str, T]):
    def __init__(self, kind: str, package: str, builtins: tuple[str, ...], param: str):
        super().__init__()
        self.kind, self.package, self.builtins, self.param = kind, package, builtins, param

    def register(self, *names: str) -> Callable[[T], T]:
        def wrap(entry: T) -> T:
            for name in names:
                self[name] = entry
            return entry

        return wrap

    def load_builtins(self) -> None:
        for module in self.builtins:
            importlib.import_module(f"{self.package}.{module}")

    def available(self) -> list[str]:
        self.load_builtins()
        return sorted(self)

    def lookup(self, name) -> T:
        """The entry registered as `name`, or a one-line error listing the known ones."""
        self.load_builtins()
        entry = self.get(name) if isinstance(name, str) else None
        if entry is None:
            raise SpecdecError(f"unknown {self.kind} {str(name)[:64]!r}; "
                               f"choose one of: {', '.join(self.available())}", self.param)
        return entry
