#!/usr/bin/env bash
# Builds a wheel with the async-IO op compiled in, installs it into a fresh venv and runs the tests against it
# (from a copy of tests/ outside the source tree, so `import deepoffload` is the installed wheel).
#   ci/prebuild.sh [pytest args...]      e.g. ci/prebuild.sh -m "not slow"
# Needs torch in the current environment to build (the op is compiled against it: --no-build-isolation).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/deepoffload-prebuild.XXXXXX")
trap 'rm -rf "$work"' EXIT
torch_version=$(python -c 'import torch; print(torch.__version__.split("+")[0])')

git -C "$repo" archive --format=tar HEAD | tar -x -C "$work" --one-top-level=src 2>/dev/null \
  || { mkdir -p "$work/src"; cp -r "$repo"/. "$work/src"; rm -rf "$work/src/build"; }
DEEPOFFLOAD_BUILD_AIO=1 python -m pip wheel --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/deepoffload-*.whl)
python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
ops = [n for n in names if n.startswith("deepoffload/_ops/deepoffload_aio")]
if not ops or "deepoffload/_ops/build_info.json" not in names:
    sys.exit(f"the wheel lacks the prebuilt op: {ops}")
print("wheel carries", ops[0])
PY

python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "torch==$torch_version" "$wheel" pytest hypothesis numpy
cp -r "$repo/tests" "$work/tests"
cp -r "$repo/csrc" "$work/csrc"  # the native tests (tests/native, Wine) compile the C++ sources directly
cp "$repo/pyproject.toml" "$work/"
cd "$work"
DEEPOFFLOAD_CACHE_DIR="$work/cache" "$work/venv/bin/python" - <<'PY'
import os, sys
from deepoffload.op_builder import AsyncIOBuilder
module = AsyncIOBuilder().load_native()
if "/_ops/" not in module.__file__:
    sys.exit(f"the prebuilt op was not used: {module.__file__}")
if os.path.exists(os.path.join(os.environ["DEEPOFFLOAD_CACHE_DIR"], "build")):
    sys.exit("something was compiled although the op is prebuilt")
print("prebuilt op loads without compiling:", module.__file__)
PY
DEEPOFFLOAD_CACHE_DIR="$work/cache" "$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
