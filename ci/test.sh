#!/usr/bin/env bash
# Installs the test dependencies and runs the whole suite (slow tests included), as the README says.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m pytest -q "$@"
