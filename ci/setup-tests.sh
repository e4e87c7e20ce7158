#!/usr/bin/env bash
# One command from a fresh clone to a passing suite: installs the system packages the op and the tests need
# (apt-get, as root or through sudo), makes .venv with torch 2.13.0 and deepoffload with its test and docs extras,
# prints the versions tested, then runs ci/test.sh (lint, types, the whole suite, python -O, sanitizers, the docs
# site). Idempotent. .ci/run calls it. Arguments go to pytest (through ci/test.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/setup.sh

# Every step runs and reports even when an earlier one failed (a missing system package fails only the tests that
# need it); the exit status is non-zero when any step failed.
failed=0
echo "=== ci/setup-tests.sh: system packages"
system_packages "${MAIN_PACKAGES[@]}" "${TEST_PACKAGES[@]}" || { echo "=== system packages: FAILED"; failed=1; }
echo "=== ci/setup-tests.sh: python environment"
python_env "[test,docs]" || { echo "=== python environment: FAILED (making .venv or installing into it)"; failed=1; }
[ -f .venv/bin/activate ] && . .venv/bin/activate
echo "=== ci/setup-tests.sh: versions tested"
python ci/versions.py || { echo "=== versions tested: FAILED"; failed=1; }
bash ci/test.sh "$@" || failed=1
exit $failed
