# Sourced by ci/setup-demo.sh and ci/setup-tests.sh: the set-up steps both share. Each is idempotent (apt-get
# installs only what is missing, the virtual environment is made once, pip leaves what is installed in place).

# as_root COMMAND...: run as root: directly when root, through sudo when it is installed, else fail saying so.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "not root and no sudo: as root, run: $*" >&2
    return 1
  fi
}

# system_packages PACKAGE...: install the Debian/Ubuntu packages that are missing (apt-get; root or sudo).
system_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && { echo "system packages: all present ($*)"; return 0; }
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "no apt-get here: install ${missing[*]} (or their equivalents) yourself" >&2
    return 1
  fi
  echo "system packages: installing ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# python_env: the virtual environment .venv (made once) with pip and setuptools upgraded, torch 2.13.0 (the CPU
# wheel: a range would pull a CUDA build of several GB) and this checkout installed editable with EXTRAS ("" or
# ".[hf]"-style extras, e.g. "[test,docs]"); leaves it activated.
python_env() {
  local extras=${1:-}
  [ -f .venv/bin/activate ] || python3 -m venv .venv || return 1
  . .venv/bin/activate || return 1
  python -m pip install -q -U pip setuptools || return 1
  python -m pip install -q torch==2.13.0 -e ".$extras"
}

# The op's build (g++, python3-dev), its libaio and io_uring engines, the virtual environment, fio for
# `deepoffload bench --compare-fio`, libdeflate for the CRC-32 of `deepoffload.save` (about 3x zlib; optional).
MAIN_PACKAGES=(g++ python3-dev python3-venv libaio-dev liburing-dev fio libdeflate0)
# The tests besides: MinGW-w64 and Wine for the Windows engine's tests (cross-compiled, run under Wine; about 50 s
# to install), strace for tests/io/test_direct_alignment.py (reads the addresses of the op's system calls).
# chromium: tests/test_docs_site.py opens the built site headless to check that no main page scrolls sideways.
TEST_PACKAGES=(g++-mingw-w64-x86-64 wine strace chromium)
