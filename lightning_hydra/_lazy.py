"""Package exports that load their module on first use (PEP 562).

Lightning and torchmetrics take two seconds to import. With lazy exports, ``import lightning_hydra.planner`` or
``lightning_hydra.cp`` imports neither: planner benchmarks and spawned ranks that run only the engine start in a
third of the time, and a package's names still read as ``from lightning_hydra import HydraStrategy``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names load on first use.

    Args:
        package: The package's ``__name__``.
        where: Each public name and the module that defines it.

    Returns:
        The two module-level hooks; assign them to the package's ``__getattr__`` and ``__dir__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)  # later reads skip this hook
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
