// Facts about the machine and a folder that the report and the engine choice use: direct-IO alignment, and a
// write + read round trip through an engine.
#include "diagnostics.h"

#include <cerrno>
#include <cstring>
#include <exception>

#include "io_handle.h"
#include "platform.h"

namespace deepoffload {

int probe_dio_alignment(const std::string& path, size_t* memory_alignment, size_t* offset_alignment,
                        bool* direct_supported) {
    *memory_alignment = 4096;
    *offset_alignment = 4096;
    *direct_supported = false;
    int kind = platform::path_kind(path);
    if (kind < 0) return kind;
    std::string probe_path = path;
    if (kind == 1) {
        if (platform::make_temp_file(path, ".deepoffload-dio-", &probe_path) < 0) return 0;  // unknown
    }
    int fd = platform::open_file(probe_path, false, true);
    if (fd >= 0) {
        platform::DioAlignment a = platform::query_dio_alignment(fd);
        platform::close_file(fd);
        *direct_supported = a.supported;
        if (a.known && a.supported) {
            *memory_alignment = a.memory;
            *offset_alignment = a.offset;
        }
    }
    if (kind == 1) platform::remove_path(probe_path);
    return 0;
}

bool engine_self_test(const std::string& engine, const std::string& directory, std::string* reason) {
    std::string path;
    char* out = nullptr;
    char* in = nullptr;
    bool ok = false;
    try {
        int rc = platform::make_temp_file(directory, ".deepoffload-selftest-", &path);
        if (rc < 0) {
            *reason = "cannot create a temporary file in '" + directory + "': " + platform::errno_text(-rc);
            return false;
        }
        const size_t nbytes = 256 * 1024;
        out = static_cast<char*>(platform::aligned_alloc_bytes(4096, nbytes));
        in = static_cast<char*>(platform::aligned_alloc_bytes(4096, nbytes));
        if (out == nullptr || in == nullptr) {
            *reason = "cannot allocate test buffers: " + platform::errno_text(ENOMEM);
        } else {
            for (size_t i = 0; i < nbytes; ++i) out[i] = static_cast<char>((i * 131 + 7) & 0xff);
            std::memset(in, 0, nbytes);
            HandleConfig config;
            config.engine = engine;
            config.block_size = 64 * 1024;
            config.queue_depth = 4;
            config.intra_op_parallelism = 1;
            IoHandle handle(config);
            OpResult w, r;
            handle.wait(handle.submit(true, out, nbytes, path, -1, 0, kFlagTruncate), -1, &w);
            if (w.err == 0) handle.wait(handle.submit(false, in, nbytes, path, -1, 0, 0), -1, &r);
            if (w.err != 0) {
                *reason = engine + ": " + w.operation + " failed: " + w.detail;
            } else if (r.err != 0) {
                *reason = engine + ": " + r.operation + " failed: " + r.detail;
            } else if (!w.direct || !r.direct) {
                *reason = "O_DIRECT is not supported in '" + directory + "' (" + platform::errno_text(EINVAL) + ")";
            } else if (std::memcmp(out, in, nbytes) != 0) {
                *reason = engine + ": data read back differs from data written";
            } else {
                ok = true;
                reason->clear();
            }
        }
    } catch (const std::exception& e) {
        *reason = e.what();
        ok = false;
    }
    platform::aligned_free(out);
    platform::aligned_free(in);
    if (!path.empty()) platform::remove_path(path);
    return ok;
}

}  // namespace deepoffload
