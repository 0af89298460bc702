"""``python -m lightning_hydra``: the same as the ``lightning-hydra`` command."""

import sys

from lightning_hydra.cli import main

sys.exit(main())
