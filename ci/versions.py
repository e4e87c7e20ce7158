"""Print the versions CI tests with, and fail when the installed ones are not the test extra's pins.

The test extra in pyproject.toml pins the integrations (transformers, accelerate, peft, DeepSpeed, safetensors);
the user-facing extras (hf, deepspeed) are bounded above by the same versions; the getting-started page's
"What is tested" sentence is the one ``tested_sentence()`` writes (tests/test_ci.py checks both). Run by
ci/setup-tests.sh before the suite: ``python ci/versions.py``.
"""

from __future__ import annotations

import platform
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH = "2.13.0"  # the CPU wheel ci/setup.sh installs
INTEGRATIONS = ("deepspeed", "transformers", "accelerate", "peft", "safetensors")
NAMES = {"deepspeed": "DeepSpeed"}


def pins() -> dict[str, str]:
    """{distribution: version} of the test extra's ``==`` pins of the integrations."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["optional-dependencies"]["test"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][^ ;]*)", requirement)
        if match and match.group(1) in INTEGRATIONS:
            found[match.group(1)] = match.group(2)
    return found


def tested_sentence() -> str:
    """The getting-started page's sentence naming what CI tests, from the pins."""
    versions = pins()
    listed = [f"{NAMES.get(name, name)} {versions[name]}" for name in INTEGRATIONS]
    return (
        f"CI (`.ci/run`) tests **Python 3.11 with torch {TORCH}** (CPU build) on Debian 12, with "
        + ", ".join(listed[:-1])
        + f" and {listed[-1]} for the integrations."
    )


def main() -> int:
    """Print the tested versions; 1 when one installed differs from its pin (or is missing)."""
    wrong = []
    print(f"tested with: Python {platform.python_version()}")
    for name, pinned in [("torch", TORCH), *pins().items()]:
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        print(f"tested with: {name} {installed}")
        if installed.split("+")[0] != pinned:
            wrong.append(f"{name} {installed} (pinned {pinned})")
    if wrong:
        print("ci/versions.py: installed versions differ from the pins: " + ", ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
