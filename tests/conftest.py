"""Shared fixtures. The op is built once per test session into one cache directory (``DEEPOFFLOAD_CACHE_DIR`` if
set, else a per-user folder under the temp dir that later runs reuse), and scratch files live on a real disk so
O_DIRECT is exercised (``DEEPOFFLOAD_TEST_DIR`` to choose one)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("DEEPOFFLOAD_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"deepoffload-test-cache-{os.getuid()}"))


@pytest.fixture(scope="session")
def aio():
    """The native async-IO module (built on first use)."""
    from deepoffload.io.native import native

    return native()


@pytest.fixture
def scratch(tmp_path_factory) -> Path:
    """A fresh folder on a filesystem that accepts O_DIRECT (not tmpfs)."""
    base = os.environ.get("DEEPOFFLOAD_TEST_DIR")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=base, prefix="scratch-"))
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture
def handle(aio):
    from deepoffload import AsyncIOHandle

    with AsyncIOHandle() as h:
        yield h
