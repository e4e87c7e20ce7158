"""The Windows engine of the native op (overlapped IO; compiled in on Windows only)."""

from .native_engine import NativeEngine

ENGINE = NativeEngine(
    "windows", "Windows overlapped ReadFile/WriteFile on an IO completion port; compiled in on Windows only"
)
