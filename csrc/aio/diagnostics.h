// Diagnostics of the machine and a folder, without a handle of the caller's (diagnostics.cpp).
#pragma once

#include <cstddef>
#include <string>

namespace deepoffload {

// Direct-IO alignment of an existing file or directory (a directory is probed
// with a temporary file). Returns 0 or -errno (only when the path is missing or
// unusable); unknown alignment is reported as 4096/4096.
int probe_dio_alignment(const std::string& path, size_t* memory_alignment, size_t* offset_alignment,
                        bool* direct_supported);

// Small O_DIRECT write + read round trip through `engine` in `directory`.
// Returns true, or false with a reason (including errno text). Never throws.
bool engine_self_test(const std::string& engine, const std::string& directory, std::string* reason);

}  // namespace deepoffload
