"""A child Python process killed by its own SIGKILL mid-run: what a crash leaves for the next run to clean."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_until_killed(code: str) -> str:
    """Run ``code`` (which ends by sending itself SIGKILL) in a child from the repository's root, check that it died
    of that signal, and return what it printed."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return proc.stdout
