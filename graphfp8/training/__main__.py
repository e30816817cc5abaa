"""`python -m graphfp8.training` and `torchrun -m graphfp8.training`: the graphfp8-train command."""

from __future__ import annotations

from graphfp8.training.cli import main

raise SystemExit(main())
