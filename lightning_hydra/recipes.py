"""Where the repository's recipes live and how a recipe is named: shared by the training CLI and the simulator's."""

from __future__ import annotations

from pathlib import Path

__all__ = ["RECIPES", "recipe_path"]

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
"""The repository's ``recipes/`` directory (an editable install, as the README's set-up makes)."""


def recipe_path(name: str) -> Path:
    """Path of a recipe given by file path or by name (``cpu-demo`` -> ``recipes/cpu-demo.yaml``)."""
    path = Path(name)
    if path.exists():
        return path
    candidate = RECIPES / (name if name.endswith(".yaml") else f"{name}.yaml")
    if candidate.exists():
        return candidate
    known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
    raise FileNotFoundError(f"no recipe {name!r} (looked for {path} and {candidate}; recipes: {known})")
