"""A handle collected without ``close()``: an error closing it is reported (``sys.unraisablehook``), not swallowed,
and a handle whose construction failed has nothing to close and reports nothing."""

from __future__ import annotations

import errno
import gc
import sys

import pytest

from deepoffload import AsyncIOHandle


class _FailingClose:
    def close(self) -> None:
        raise OSError(errno.EIO, "close failed")


def test_an_error_closing_a_collected_handle_reaches_the_unraisable_hook(aio, monkeypatch):
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    handle = AsyncIOHandle()
    native, handle._backend = handle._backend, _FailingClose()
    del handle
    gc.collect()
    native.close()
    assert len(seen) == 1 and isinstance(seen[0], OSError) and seen[0].errno == errno.EIO


def test_a_handle_whose_construction_failed_reports_nothing_when_collected(aio, monkeypatch):
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    with pytest.raises(ValueError, match="block_size"):
        AsyncIOHandle(block_size=2**64)
    gc.collect()
    assert seen == []
