"""``python -m deepoffload``: the ``deepoffload`` command line (``deepoffload.cli``)."""

from .cli.main import main

raise SystemExit(main())
