"""How the ``lightning-hydra`` command says an error: one line naming the problem, once.

An error every rank finds alike (a :class:`~lightning_hydra.errors.ConfigError`) is said by global rank 0; one that
only some ranks see, by the rank that found it; a rank that only noticed another rank going away says nothing of its
own (rank 0 says that another rank failed). ``--traceback`` prints every rank's full traceback instead, under a
line naming the rank (:func:`report_error`). A bad option or recipe value, which jsonargparse reports as a nested
union of every type it tried, becomes one line naming the option (:func:`argument_reason`).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

__all__ = ["argument_reason", "current_rank", "report_error"]

_SECONDARY = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket Timeout|NCCL communicator was aborted|"
    r"ProcessGroup(Gloo|NCCL).*(closed|abort)|Connection refused",
    re.IGNORECASE,
)


def _is_secondary(exc: BaseException) -> bool:
    """Whether ``exc`` is a rank noticing that another rank went away (not a problem of its own: a rank that
    cannot open its own socket, for example, is not)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _SECONDARY.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def current_rank() -> int:
    """This process's global rank as the launcher set it in the environment (0 when not launched as a rank)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    if rank is None:
        for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name])
        return 0
    return int(rank)


def _union_reason(text: str) -> str:
    """The cause inside jsonargparse's "Does not validate against any of the Union subtypes" message (a class
    given by ``class_path`` whose constructor raised is listed beside the type mismatches of the other subtypes)."""
    if not text.startswith("Does not validate against any of the Union subtypes") or "\nErrors:" not in text:
        return text
    block = text.split("\nErrors:", 1)[1].split("\nGiven value type:", 1)[0]
    reasons = [r.strip() for r in re.split(r"^\s*- ", block, flags=re.M) if r.strip()]
    causes = [r for r in reasons if not r.startswith(("Expected a <class", "Not a valid subclass", "Type <class"))]
    return " ".join((causes or reasons or [text])[0].split())


_SCAFFOLD = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "Problem with given class_path")
"""Lines of jsonargparse's nested messages that frame a cause rather than say one."""


def argument_reason(text: str) -> str:
    """One line from jsonargparse's nested message about a bad command-line or recipe value: the setting (as its
    ``--`` option path) and, from the innermost ``Parser key`` block, the cause it gives or the types it expected and
    the value it got (``--trainer.strategy.init_args.max_tokens_per_rank: expected int or Literal['auto'], got
    'abc'``)."""
    keys = re.findall(r'Parser key "([^"]+)":', text)
    if not keys:
        return " ".join(text.split())
    lines = text.splitlines()
    at = max(i for i, line in enumerate(lines) if f'Parser key "{keys[-1]}":' in line)
    indent = len(lines[at]) - len(lines[at].lstrip())
    inner = [lines[at].split(f'Parser key "{keys[-1]}":', 1)[1].strip()]  # the innermost block: the rest of its
    # key's line and the lines indented below it
    for line in lines[at + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        inner.append(line.strip().removeprefix("- "))
    inner = [line for line in inner if line]
    name = "--" + (".init_args." if "Problem with given class_path" in text else ".").join(keys)
    causes = [line for line in inner if not line.startswith(("Expected a ", *_SCAFFOLD))]
    if causes:
        return f"{name}: {' '.join(causes)}"
    expected, got = [], None
    for line in inner:
        match = re.match(r"Expected a (?:<class '([^']+)'>|(.+?))(?:\. Got value: (.*))?$", line)
        if match:
            expected.append((match.group(1) or match.group(2)).removeprefix("typing."))
            got = got if match.group(3) is None else match.group(3)
        elif line.startswith("Given value:") and got is None:
            got = line.split(":", 1)[1].strip()
    said = f"expected {' or '.join(expected)}" if expected else "not accepted"
    return f"{name}: {said}" + (f", got {got!r}" if got is not None else "")


def _message(exc: BaseException) -> str:
    from lightning_hydra.errors import ConfigError

    text = _union_reason(str(exc).strip()) or type(exc).__name__
    if isinstance(exc, (ConfigError, ValueError, TypeError, FileNotFoundError)):
        return text.splitlines()[0] if isinstance(exc, FileNotFoundError) else text
    return f"{type(exc).__name__}: {text} (--traceback for details)"


def report_error(exc: BaseException, *, rank: int, show_traceback: bool = False) -> None:
    """Print ``exc`` the way the command does: one line, once (see the module documentation).

    With ``show_traceback`` (``--traceback``) every rank prints, instead of that line, one line naming its rank
    (``lightning-hydra: traceback of the error on rank 2:``: the ranks of one run share a terminal, and their
    tracebacks would otherwise read as one) and then Python's full traceback of ``exc``: ``Traceback (most recent
    call last):``, the frames from where it was caught down to where it was raised, the chained causes, and the
    exception's type and message last.

    Args:
        exc: The error.
        rank: This process's global rank.
        show_traceback: Print the full traceback instead (every rank).
    """
    from lightning_hydra.errors import ConfigError, RankDiedError

    if show_traceback:
        print(f"lightning-hydra: traceback of the error on rank {rank}:", file=sys.stderr, flush=True)
        traceback.print_exception(exc, file=sys.stderr)
        return
    if isinstance(exc, RankDiedError):  # the launching process names the rank that died (nobody else can)
        print(f"lightning-hydra: stopped: {exc}", file=sys.stderr, flush=True)
        return
    secondary = _is_secondary(exc)
    if rank == 0:
        line = (
            "stopped: another rank failed (its error is printed by that rank; --traceback for details)"
            if secondary
            else f"error: {_message(exc)}"
        )
    elif secondary or isinstance(exc, ConfigError):
        return  # rank 0 says it (a ConfigError is found the same way on every rank), or the failing rank does
    else:
        line = f"error on rank {rank}: {_message(exc)}"
    print(f"lightning-hydra: {line}", file=sys.stderr, flush=True)
