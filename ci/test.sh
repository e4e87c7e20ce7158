#!/usr/bin/env bash
# Installs the test dependencies, lints (ruff, configured in pyproject.toml), type-checks (mypy) and runs the whole suite (slow tests
# included), as dev-notes/development.md says; then the core tests again under `python -O` (library code must not rely on assert,
# which tests/test_no_assert.py checks statically; pytest still rewrites the tests' own asserts and conftest's into
# real checks, so they are not vacuous there), the op-level tests under ASan/UBSan, and the documentation site
# (mkdocs build --strict, with the docs extra installed).
# Every phase runs even when an earlier one fails; the result of each is printed at the end, and the exit status is
# non-zero when any failed. Test runs keep their scratch files in one temporary folder, removed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

# the docs extra too: tests/test_docs_site.py builds pages with mkdocs and draws the plots with matplotlib
python -m pip install -q -e ".[test,docs]" || { echo "ci/test.sh: installing the test dependencies failed" >&2; exit 1; }

scratch="$(mktemp -d "${TMPDIR:-/tmp}/deepoffload-ci.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
# pytest's tmp_path folders, the swap and bench files and the sanitizer build all go under $scratch.
export TMPDIR="$scratch"
export DEEPOFFLOAD_SANITIZE_CACHE_DIR="$scratch/sanitize-cache"

names=() results=() failed=0
phase() {
  local name="$1" start=$SECONDS status=0
  shift
  echo "=== ci/test.sh: $name"
  "$@" || status=$?
  names+=("$name")
  results+=("$([[ $status -eq 0 ]] && echo passed || echo "FAILED (exit status $status)") in $((SECONDS - start)) s")
  [[ $status -eq 0 ]] || failed=1
}

lint() { python -m ruff check . && python -m ruff format --check .; }
phase "lint (ruff check, ruff format --check)" lint
phase "types (mypy)" python -m mypy  # deepoffload/ and op_builder/, configured in pyproject.toml
# Two workers (pytest-xdist), each file on one of them: most slow tests wait on compilers, children and the disk,
# so this halves the phase on two cores (measured 763 s against 1476-1735 s in one process).
phase "full suite" python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 \
  --basetemp="$scratch/pytest" "$@"
# Under -O: the static check (tests/test_no_assert.py, also in the whole suite) proves no library code uses assert or
# __debug__; this phase runs the core paths (handle, swapping, optimizer, streaming, checkpoints) with them stripped.
phase "core tests under python -O" python -O -m pytest -q -p no:cacheprovider --basetemp="$scratch/pytest-O" \
  -m "not slow" tests/test_no_assert.py tests/test_api.py tests/io/test_handle.py tests/io/test_handle_inputs.py \
  tests/swap/test_swap_tensor.py tests/swap/optimizer/test_optimizer_contract.py \
  tests/swap/params/test_params_patterns.py tests/checkpoint/test_checkpoint.py tests/formats/test_formats.py "$@"
phase "sanitizers (ASan + UBSan)" env PYTHON=python bash ci/sanitize.sh --basetemp="$scratch/pytest-sanitize" "$@"
docs() {
  python -m pip install -q -e ".[docs]" || { echo "ci/test.sh: installing the docs extra failed" >&2; return 1; }
  NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "$scratch/site"
}
phase "docs (mkdocs build --strict)" docs

echo "=== ci/test.sh: results"
for i in "${!names[@]}"; do
  printf '  %-30s %s\n' "${names[$i]}" "${results[$i]}"
done
exit $failed
