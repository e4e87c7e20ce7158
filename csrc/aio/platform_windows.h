// Windows-only extras of the platform layer, shared by platform_windows.cpp and
// engine_windows.cpp. Nothing outside those two files includes this header.
//
// Descriptors are C runtime descriptors (the `int` that Python's os.open
// returns on Windows) wrapping a Win32 HANDLE. Files opened by
// platform::open_file are overlapped (FILE_FLAG_OVERLAPPED) and bound to one
// process-wide I/O completion port; caller-supplied descriptors are used as
// they are (usually synchronous handles).
#pragma once
#if defined(_WIN32)

#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>

namespace deepoffload {
namespace platform {
namespace windows {

// The HANDLE behind a descriptor, or INVALID_HANDLE_VALUE when the descriptor is not open.
HANDLE os_handle(int fd);

// True when `fd` was opened by open_file and its handle is bound to completion_port():
// every overlapped ReadFile/WriteFile on it then posts one completion packet there
// (unless the OVERLAPPED event's low bit is set).
bool bound_to_port(int fd);

// The process-wide completion port (created on first use), or nullptr when it cannot be created.
HANDLE completion_port();

// Maps a Win32 error code to the nearest errno and returns it negated. Remembers
// the code on the calling thread so errno_text() can name it.
int from_win32(DWORD code);

}  // namespace windows
}  // namespace platform
}  // namespace deepoffload

#endif  // _WIN32
