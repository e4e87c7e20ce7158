"""The posix engine of the native op: the portable one, compiled in wherever a C++ compiler works (not on Windows)."""

from .native_engine import NativeEngine

ENGINE = NativeEngine("posix", "pread/pwrite on the op's threads, O_DIRECT where allowed; needs only a C++ compiler")
