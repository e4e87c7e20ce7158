"""Install hints: the exact command that provides a missing piece on this system."""

from __future__ import annotations

import sys
from pathlib import Path

from . import env

# what provides each capability, per package manager
PACKAGES = {
    "cxx": {
        "apt": "g++",
        "dnf": "gcc-c++",
        "yum": "gcc-c++",
        "pacman": "gcc",
        "zypper": "gcc-c++",
        "conda": "cxx-compiler",
    },
    "libaio": {
        "apt": "libaio-dev",
        "dnf": "libaio-devel",
        "yum": "libaio-devel",
        "pacman": "libaio",
        "zypper": "libaio-devel",
        "conda": "libaio",
    },
    "io_pgetevents": {
        "apt": "libaio-dev",
        "dnf": "libaio-devel",
        "yum": "libaio-devel",
        "pacman": "libaio",
        "zypper": "libaio-devel",
        "conda": "libaio",
    },
    "liburing": {
        "apt": "liburing-dev",
        "dnf": "liburing-devel",
        "yum": "liburing-devel",
        "pacman": "liburing",
        "zypper": "liburing-devel",
        "conda": "liburing",
    },
}
COMMANDS = {
    "apt": "apt-get install {pkg}",
    "dnf": "dnf install {pkg}",
    "yum": "yum install {pkg}",
    "pacman": "pacman -S {pkg}",
    "zypper": "zypper install {pkg}",
    "conda": "conda install -c conda-forge {pkg}",
}
NOTES = {
    "io_pgetevents": "needs libaio >= 0.3.112; without it completions are reaped with io_getevents",
    "liburing": "optional: the io_uring engine; libaio and posix engines work without it",
    "libaio": "optional: the libaio engine; the posix engine works without it",
}
WINDOWS_CXX = (
    "install Visual Studio Build Tools (the 'Desktop development with C++' workload) and run from a "
    "'x64 Native Tools' prompt; pip install ninja"
)
FLAGS_HINT = (
    "if it is installed outside the system paths, set CFLAGS=-I<prefix>/include and "
    "LDFLAGS=-L<prefix>/lib (or CPATH and LIBRARY_PATH)"
)


def package_manager(os_release: Path = Path("/etc/os-release"), environ: dict | None = None) -> str:
    """The package manager to suggest: conda inside an active conda env, else from /etc/os-release."""
    if env.get("CONDA_PREFIX", environ) is not None:
        return "conda"
    try:
        fields = dict(line.split("=", 1) for line in os_release.read_text().splitlines() if "=" in line)
    except OSError:  # no /etc/os-release (not a Linux distribution that has one): suggest the most common
        return "apt"
    ids = " ".join(fields.get(k, "").strip('"').lower() for k in ("ID", "ID_LIKE"))
    for words, manager in (
        (("debian", "ubuntu"), "apt"),
        (("fedora", "rhel", "centos"), "dnf"),
        (("arch",), "pacman"),
        (("suse",), "zypper"),
    ):
        if any(w in ids for w in words):
            return manager
    return "apt"


def install_hint(capability: str, platform: str = sys.platform, manager: str | None = None) -> str:
    """One line: how to get ``capability`` ("cxx", "libaio", "io_pgetevents", "liburing") on this system."""
    if platform == "win32":
        return WINDOWS_CXX if capability == "cxx" else "not applicable on Windows"
    manager = manager or package_manager()
    pkg = PACKAGES.get(capability, {}).get(manager)
    if pkg is None:
        return FLAGS_HINT
    hint = COMMANDS[manager].format(pkg=pkg)
    if capability != "cxx":
        hint += f"; {FLAGS_HINT}"
    return hint
