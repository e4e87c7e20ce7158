"""The ``deepoffload`` command line: report, bench, tune, demo."""
