#!/usr/bin/env bash
# One command from a fresh clone to the demo: installs the system packages the op needs (apt-get, as root or through
# sudo; where neither works it names them and goes on), makes .venv with torch 2.13.0 and deepoffload, then runs
# `deepoffload report` and `deepoffload demo`. Idempotent: run it again and it only runs the demo.
#   bash ci/setup-demo.sh            # the package alone
#   bash ci/setup-demo.sh "[hf]"     # with extras (hf, deepspeed, plot, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/setup.sh

system_packages "${MAIN_PACKAGES[@]}" || echo "going on without them: deepoffload report below says what is missing" >&2
python_env "${1:-}"
deepoffload report
deepoffload demo
echo "ready: . .venv/bin/activate"
