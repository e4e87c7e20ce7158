#!/usr/bin/env bash
# Installs the test dependencies and runs the whole suite (slow tests included), as the README says; then the fast
# suite again under `python -O` (library code must not rely on assert; pytest still rewrites the tests' own asserts
# and conftest's into real checks, so they are not vacuous there), and the op-level tests under ASan/UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m pytest -q "$@"
python -O -m pytest -q -p no:cacheprovider -m "not slow" "$@"
PYTHON=python bash ci/sanitize.sh
