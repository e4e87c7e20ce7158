"""DeepSpeed's calling conventions for ``aio_handle``'s methods: required arguments, ``filename`` or ``fd``, ``async``.

DeepSpeed's binding takes a file as a path or as an open descriptor and names one argument ``async`` (a Python
keyword); these helpers accept its spellings and raise ``TypeError`` as Python does for a missing or doubled one.
"""

from __future__ import annotations

from typing import Any

from .inputs import FileRef

MISSING: Any = object()  # the default of arguments of any type that DeepSpeed requires: "not given"


def required(value, name: str, method: str):
    """``value``, or the ``TypeError`` Python raises for a missing argument when it is ``MISSING``.

    Args:
        value: The argument as passed.
        name: Its name.
        method: The ``aio_handle`` method it was passed to.

    Returns:
        ``value``.

    Raises:
        TypeError: When ``value`` is ``MISSING``.
    """
    if value is MISSING:
        raise TypeError(f"aio_handle.{method}() missing required argument '{name}'")
    return value


def file_argument(filename, fd, method: str) -> FileRef:
    """DeepSpeed's overloads: a path as ``filename``, or an open descriptor as ``fd`` (or positionally).

    Args:
        filename: The path (or a descriptor passed positionally), or ``MISSING``.
        fd: The open descriptor passed by name, or None.
        method: The ``aio_handle`` method they were passed to.

    Returns:
        The path or descriptor.

    Raises:
        TypeError: When both or neither are given, or ``fd`` is not an int.
    """
    if fd is not None:
        if filename is not MISSING:
            raise TypeError(f"aio_handle.{method}(): pass either filename or fd, not both")
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"aio_handle.{method}(): fd must be an int (an open descriptor), got {type(fd).__name__}")
        return fd
    return required(filename, "filename", method)


def async_flag(async_op, kwargs: dict, method: str) -> bool:
    """DeepSpeed names this argument ``async`` (a Python keyword: pass it as ``**{"async": True}``).

    Args:
        async_op: The argument passed as ``async_op``, or ``MISSING``.
        kwargs: The other keyword arguments (``async`` is taken out of it; nothing else may be left).
        method: The ``aio_handle`` method they were passed to.

    Returns:
        Whether the call is asynchronous.

    Raises:
        TypeError: When ``async`` is given twice or not at all, or another keyword is unknown.
    """
    if "async" in kwargs:
        if async_op is not MISSING:
            raise TypeError(f"aio_handle.{method}(): got 'async' twice")
        async_op = kwargs.pop("async")
    if kwargs:
        raise TypeError(f"aio_handle.{method}() got unexpected keyword arguments {sorted(kwargs)}")
    return bool(required(async_op, "async", method))
