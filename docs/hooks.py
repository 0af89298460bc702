"""MkDocs hooks: the generated configuration reference and the visible marks of blocks that need a GPU or a cluster.

``<!-- generated: configuration reference -->`` in a page becomes the tables of
:func:`lightning_hydra.docs_reference.reference_markdown` (read from the code at every build).
``<!-- needs: gpu -->`` (``cluster``, or ``sketch`` for a block with ``...`` placeholders) before a code block,
which ``tests/test_docs.py`` reads to skip the block, becomes a visible note.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_hydra.docs_reference import reference_markdown

MARK = "<!-- generated: configuration reference -->"
NEEDS = re.compile(r"^<!-- needs: (gpu|cluster|sketch) -->$", re.M)
SAYS = {
    "gpu": '!!! note "Needs a GPU"\n    Not run by the tests: this machine has no GPU.\n',
    "cluster": '!!! note "Needs a cluster"\n    Not run by the tests: it needs several nodes (SLURM or torchrun).\n',
    "sketch": '!!! note "A sketch"\n    The `...` stand for your own arguments; not run by the tests as written.\n',
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill in the generated reference and make the needs-marks visible."""
    if MARK in markdown:
        markdown = markdown.replace(MARK, reference_markdown())
    return NEEDS.sub(lambda m: SAYS[m.group(1)], markdown)
