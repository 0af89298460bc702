"""The configuration reference of the docs, generated from the code so that it cannot drift.

Reads the ``__init__`` signatures and the Google-style ``Args:`` sections of the configured classes from their
source files (with :mod:`ast`: nothing is imported, so it runs in milliseconds) and writes one Markdown table per
class: every argument with its type, default and meaning. ``docs/hooks.py`` puts the tables into
``docs/configuration.md`` at build time; ``python -m lightning_hydra.docs_reference`` prints them.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CLASSES", "Argument", "arguments", "main", "reference_markdown"]

_PACKAGE = Path(__file__).resolve().parent

#: The classes of the reference: (import path shown to users, source file inside the package, class name).
CLASSES: tuple[tuple[str, str, str], ...] = (
    ("lightning_hydra.HydraStrategy", "strategy/strategy.py", "HydraStrategy"),
    ("lightning_hydra.HydraDataModule", "data/datamodule.py", "HydraDataModule"),
    ("lightning_hydra.BubbleMonitor", "metrics/monitor.py", "BubbleMonitor"),
)


@dataclass(frozen=True)
class Argument:
    """One argument of a class's ``__init__``: its name, annotation, default (``None`` when required) and the
    description its docstring gives (empty when it gives none)."""

    name: str
    annotation: str
    default: str | None
    description: str


def _init(source: str, class_name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return item
    raise LookupError(f"{class_name}.__init__ not found")


def _descriptions(docstring: str) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring: argument name -> its description on one line."""
    out: dict[str, str] = {}
    lines = docstring.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    indent = None
    name = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break  # the next section (Raises:, Returns:) or the end
        found = re.match(r"(\w+)(?: \([^)]*\))?: (.*)", line.strip())
        if width == indent and found:
            name = found.group(1)
            out[name] = found.group(2)
        elif name is not None and width > indent:
            out[name] += " " + line.strip()
    return {key: re.sub(r"\s+", " ", value).strip() for key, value in out.items()}


def _constant(name: str) -> str | None:
    """The literal a module-level constant of the package is assigned (``PAD_ID = 256``), if one is."""
    for path in sorted(_PACKAGE.rglob("*.py")):
        found = re.search(rf"^{re.escape(name)}(?:: [^=]+)? = (.+)$", path.read_text(), re.M)
        if found:
            try:
                ast.literal_eval(found.group(1).split("  #")[0])
            except (ValueError, SyntaxError):
                continue
            return found.group(1).split("  #")[0].strip()
    return None


def _default(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    text = ast.unparse(node)
    value = _constant(text) if isinstance(node, ast.Name) else None
    return text if value is None else f"{text} = {value}"


def arguments(source_file: str, class_name: str) -> list[Argument]:
    """Every argument of ``class_name.__init__`` in ``source_file`` (relative to the package), in order."""
    init = _init((_PACKAGE / source_file).read_text(), class_name)
    described = _descriptions(ast.get_docstring(init) or "")
    positional = init.args.posonlyargs + init.args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(init.args.defaults)) + list(init.args.defaults)
    pairs = [*zip(positional, defaults, strict=True), *zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True)]
    return [
        Argument(
            name=arg.arg,
            annotation=ast.unparse(arg.annotation) if arg.annotation is not None else "",
            default=_default(default),
            description=described.get(arg.arg, ""),
        )
        for arg, default in pairs
        if arg.arg != "self"
    ]


def _cell(text: str) -> str:
    """Markdown table cell text: pipes escaped, reStructuredText roles and double backticks made plain code."""
    text = re.sub(r":(?:class|func|mod|data|meth|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|")


def reference_markdown(level: int = 2) -> str:
    """The reference: for each of :data:`CLASSES` a heading of ``level`` and a table of its arguments."""
    parts = []
    for shown, source_file, class_name in CLASSES:
        rows = ["| argument | type | default | meaning |", "| --- | --- | --- | --- |"]
        for arg in arguments(source_file, class_name):
            default = "required" if arg.default is None else f"`{arg.default}`"
            annotation = f"`{arg.annotation}`" if arg.annotation else ""
            rows.append(f"| `{arg.name}` | {_cell(annotation)} | {_cell(default)} | {_cell(arg.description)} |")
        parts.append(f"{'#' * level} `{shown}`\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Print the reference as Markdown."""
    del argv
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
