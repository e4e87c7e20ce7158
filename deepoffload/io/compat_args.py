"""DeepSpeed's calling conventions for ``aio_handle``'s methods: required arguments, ``filename`` or ``fd``, ``async``.

DeepSpeed's binding takes a file as a path or as an open descriptor and names one argument ``async`` (a Python
keyword); these helpers accept its spellings and raise ``TypeError`` as Python does for a missing or doubled one.
"""

from __future__ import annotations

from typing import Any

from .inputs import FileRef

_MISSING: Any = object()  # the default of arguments of any type that DeepSpeed requires: "not given"


def _required(value, name: str, method: str):
    if value is _MISSING:
        raise TypeError(f"aio_handle.{method}() missing required argument '{name}'")
    return value


def _file(filename, fd, method: str) -> FileRef:
    """DeepSpeed's overloads: a path as ``filename``, or an open descriptor as ``fd`` (or positionally)."""
    if fd is not None:
        if filename is not _MISSING:
            raise TypeError(f"aio_handle.{method}(): pass either filename or fd, not both")
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"aio_handle.{method}(): fd must be an int (an open descriptor), got {type(fd).__name__}")
        return fd
    return _required(filename, "filename", method)


def _async_flag(async_op, kwargs: dict, method: str) -> bool:
    """DeepSpeed names this argument ``async`` (a Python keyword: pass it as ``**{"async": True}``)."""
    if "async" in kwargs:
        if async_op is not _MISSING:
            raise TypeError(f"aio_handle.{method}(): got 'async' twice")
        async_op = kwargs.pop("async")
    if kwargs:
        raise TypeError(f"aio_handle.{method}() got unexpected keyword arguments {sorted(kwargs)}")
    return bool(_required(async_op, "async", method))
