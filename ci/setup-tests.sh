#!/usr/bin/env bash
# One command from a fresh clone to a passing suite: installs the system packages the op and the tests need
# (apt-get, as root or through sudo), makes .venv with torch 2.13.0 and deepoffload with its test and docs extras,
# prints the versions tested, then runs ci/test.sh (lint, types, the whole suite, python -O, sanitizers, the docs
# site). Idempotent. .ci/run calls it. Arguments go to pytest (through ci/test.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. ci/setup.sh

system_packages "${MAIN_PACKAGES[@]}" "${TEST_PACKAGES[@]}" || exit 1
python_env "[test,docs]" || { echo "ci/setup-tests.sh: making .venv failed" >&2; exit 1; }
python ci/versions.py
bash ci/test.sh "$@"
