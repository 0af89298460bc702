"""The launching process's environment variables, carried to a rank in its pickled arguments.

A rank forked from a fork server has the server's environment, not the launching process's. Pickled ahead of the
rank's other arguments, a :class:`LaunchEnvironment` sets the launching process's variables as it is unpickled:
before the rank's function, model or data are unpickled and before what they import reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["LaunchEnvironment"]


class LaunchEnvironment:
    """Environment variables that replace a process's own where this object is unpickled (it unpickles as
    ``None``).

    Args:
        environ: The variables, e.g. ``dict(os.environ)`` in the launching process.
    """

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ

    def __reduce__(self) -> tuple[Callable, tuple[dict[str, str]]]:
        return _set_environment, (self.environ,)


def _set_environment(environ: dict[str, str]) -> None:
    """Replace this process's environment variables with ``environ``."""
    os.environ.clear()
    os.environ.update(environ)
