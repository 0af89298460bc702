"""Errors about bad input, and the argument checks that raise them with what was given and what is allowed.

A leaf module (it imports nothing of ours), so that every layer can check its arguments the same way.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigError", "RankDiedError", "check_bool", "check_choice", "check_int", "check_number"]


class ConfigError(ValueError):
    """Bad input (a setting, a size, the shape of the data) that every rank finds the same way.

    The ``lightning-hydra`` command prints such an error once, from global rank 0, instead of once per rank; an error
    that only some ranks can see (a token id read by one rank) is a plain ``ValueError``.
    """


class RankDiedError(RuntimeError):
    """A rank ended without a Python error of its own (killed by a signal, or a non-zero exit status), raised in
    the process that launched it; the message names the rank, its pid and how it ended."""


def check_choice(name: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``; else ``ValueError`` naming the choices (and the nearest one).

    Args:
        name: The argument's name (for the message).
        value: What was given.
        allowed: The accepted names.
    """
    allowed = list(allowed)
    if isinstance(value, str) and value in allowed:
        return value
    near = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}{hint}")


def check_int(name: str, value: Any, *, low: int | None = 1, high: int | None = None, none: bool = False) -> Any:
    """``value`` if it is an integer in ``[low, high]`` (or ``None`` when ``none``); else ``ValueError``/``TypeError``
    saying what was given and what is allowed.

    Args:
        name: The argument's name (for the message).
        value: What was given.
        low: Smallest allowed value (``None``: unbounded).
        high: Largest allowed value (``None``: unbounded).
        none: Whether ``None`` is allowed.
    """
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = "an integer" + (" or None" if none else "")
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}={value} is out of range: {_range(low, high)}")
    return int(value)


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    none: bool = False,
) -> Any:
    """``value`` if it is a finite real number in the range (``low`` excluded when ``low_open``); else an error.

    Args:
        name: The argument's name (for the message).
        value: What was given.
        low: Smallest allowed value (``None``: unbounded).
        high: Largest allowed value (``None``: unbounded).
        low_open: Exclude ``low`` itself.
        none: Whether ``None`` is allowed.
    """
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    bad_low = low is not None and (value <= low if low_open else value < low)
    if value != value or value in (float("inf"), float("-inf")) or bad_low or (high is not None and value > high):
        lower = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
        upper = "" if high is None else f"<= {high:g}"
        raise ValueError(f"{name}={value!r} is out of range: must be finite{', ' if lower or upper else ''}"
                         f"{' and '.join(x for x in (lower, upper) if x)}")  # fmt: skip
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"allowed {low}..{high}"
    if low is not None:
        return "must be positive" if low == 1 else f"must be >= {low}"
    return f"must be <= {high}"
