"""``python -m pipelines.cli …``: the ``raylens`` command without the console script."""

from pipelines.cli import main

raise SystemExit(main())
