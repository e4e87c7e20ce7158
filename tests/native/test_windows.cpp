// Windows-only native tests (run under Wine by tests/test_windows.py): what
// test_core.cpp cannot see from the portable interface. Usage:
//   test_windows <directory> [<directory on a small, nearly full volume>]
// Prints "N passed, M failed" and exits non-zero on failure.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../../csrc/aio/diagnostics.h"
#include "../../csrc/aio/engine.h"
#include "../../csrc/aio/io_handle.h"
#include "../../csrc/aio/platform.h"
#include "check.h"
#include "../../csrc/aio/platform_windows.h"

using namespace deepoffload;

namespace {


bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

struct Aligned {
    char* p;
    explicit Aligned(size_t n) : p(static_cast<char*>(platform::aligned_alloc_bytes(4096, n))) {}
    ~Aligned() { platform::aligned_free(p); }
};

OpResult run_op(IoHandle& h, bool write, char* p, size_t n, const std::string& path, int64_t off, unsigned flags) {
    OpResult r;
    h.wait(h.submit(write, p, n, path, -1, off, flags), -1, &r);
    return r;
}

// Errors carry the errno, its name and the Windows code with the system's message.
void test_error_text(const std::string& dir) {
    int fd = platform::open_file(dir + "/missing", false, true);
    check(fd == -ENOENT, "missing file gives -ENOENT, got " + std::to_string(fd));
    const std::string text = platform::errno_text(ENOENT);
    check(contains(text, "(ENOENT)") && contains(text, "[Windows error 2:"), "ENOENT text names the Windows code: " + text);
    check(platform::open_file(dir, false, false) == -EISDIR, "opening a directory as a file gives -EISDIR");
    check(platform::windows::from_win32(ERROR_DISK_FULL) == -ENOSPC, "ERROR_DISK_FULL maps to ENOSPC");
    check(platform::windows::from_win32(ERROR_HANDLE_DISK_FULL) == -ENOSPC, "ERROR_HANDLE_DISK_FULL maps to ENOSPC");
    check(platform::windows::from_win32(ERROR_INVALID_HANDLE) == -EBADF, "ERROR_INVALID_HANDLE maps to EBADF");
    check(platform::windows::from_win32(ERROR_SHARING_VIOLATION) == -EACCES, "ERROR_SHARING_VIOLATION maps to EACCES");
    check(platform::windows::from_win32(ERROR_CRC) == -EIO, "ERROR_CRC maps to EIO");
    check(platform::fd_is_direct(1000000) == -EBADF, "an unknown descriptor gives -EBADF");
}

// Files we open are overlapped and bound to the completion port; direct ones know their sector size.
void test_open_modes(const std::string& dir) {
    const std::string path = dir + "/modes";
    int fd = platform::open_file(path, true, true);
    check(fd >= 0, "open for unbuffered writing");
    if (fd < 0) return;
    check(platform::windows::bound_to_port(fd), "unbuffered descriptor is bound to the completion port");
    check(platform::fd_is_direct(fd) == 1, "fd_is_direct reports FILE_FLAG_NO_BUFFERING");
    check(platform::is_regular_file(fd) == 1, "a disk file is a regular file");
    platform::DioAlignment a = platform::query_dio_alignment(fd);
    check(a.known && a.supported && a.memory >= 512 && (a.memory & (a.memory - 1)) == 0,
          "sector alignment is reported: " + std::to_string(a.memory) + "/" + std::to_string(a.offset));
    int bfd = platform::reopen_buffered(fd, true);
    check(bfd >= 0 && platform::fd_is_direct(bfd) == 0 && platform::windows::bound_to_port(bfd),
          "reopen_buffered gives a buffered, bound descriptor");
    check(platform::truncate_fd(bfd, 12345) == 0 && platform::file_size(fd) == 12345, "truncate through the handle");
    check(platform::sync_data(bfd) == 0, "FlushFileBuffers");
    check(platform::close_file(bfd) == 0 && platform::close_file(fd) == 0, "close both");
    check(platform::file_size(fd) == -EBADF, "a closed descriptor gives -EBADF");
    platform::remove_path(path);
}

// The engine directly: 64 requests with 16 in flight, results per block, a short
// block at the end of the file, and a block wholly past it.
void test_engine_direct(const std::string& dir) {
    const size_t block = 65536, count = 64, n = block * count;
    const std::string path = dir + "/engine";
    Aligned out(n), in(n);
    for (size_t i = 0; i < n; ++i) out.p[i] = static_cast<char>(i * 7 + i / 4096);
    std::memset(in.p, 0, n);
    int wfd = platform::open_file(path, true, true);
    int rfd = platform::open_file(path, false, true);
    EngineConfig ec;
    ec.queue_depth = 16;
    EngineError error;
    std::unique_ptr<Engine> e = make_engine("windows", ec, &error);
    check(e != nullptr && wfd >= 0 && rfd >= 0, "engine and descriptors: " + error.message);
    if (!e || wfd < 0 || rfd < 0) return;
    for (bool write : {true, false}) {
        std::vector<Request> requests(count);
        for (size_t i = 0; i < count; ++i) {
            requests[i].fd = write ? wfd : rfd;
            requests[i].write = write;
            requests[i].buf = (write ? out.p : in.p) + i * block;
            requests[i].len = block;
            requests[i].offset = static_cast<int64_t>(i * block);
        }
        e->run(requests.data(), requests.size());
        bool all = true;
        for (const Request& b : requests) all = all && b.result == static_cast<int64_t>(block) && !b.submit_failed;
        check(all, std::string("engine ") + (write ? "writes" : "reads") + " 64 requests, 16 in flight");
    }
    check(std::memcmp(out.p, in.p, n) == 0, "engine round trip data");
    check(platform::truncate_fd(wfd, static_cast<int64_t>(n - block / 2)) == 0, "shorten the file");
    Request tail[2];
    for (int i = 0; i < 2; ++i) {
        tail[i].fd = rfd;
        tail[i].buf = in.p + static_cast<size_t>(i) * block;
        tail[i].len = block;
        tail[i].offset = static_cast<int64_t>(n - block) + i * static_cast<int64_t>(block);
    }
    e->run(tail, 2);
    check(tail[0].result == static_cast<int64_t>(block / 2), "engine read across the end is short: " +
                                                                   std::to_string(tail[0].result));
    check(tail[1].result == 0, "engine read past the end gives 0 bytes: " + std::to_string(tail[1].result));
    platform::close_file(wfd);
    platform::close_file(rfd);
    platform::remove_path(path);
}

// A write that runs out of space fails with ENOSPC and the Windows code, and the process lives.
void expect_disk_full(const std::string& path, size_t nbytes, const std::string& what) {
    HandleConfig c;
    c.intra_op_parallelism = 2;
    IoHandle h(c);
    Aligned buf(nbytes);
    std::memset(buf.p, 0x5a, nbytes);
    OpResult r = run_op(h, true, buf.p, nbytes, path, 0, 0);
    check(r.err == ENOSPC && r.operation == "write" &&
              (contains(r.detail, "[Windows error 112:") || contains(r.detail, "[Windows error 39:")),
          what + " gives ENOSPC with the Windows code: err=" + std::to_string(r.err) + " " + r.operation + ": " +
              r.detail);
}

void test_disk_full(const std::string& small_volume) {
    // Wine maps the Unix root to Z:, where /dev/full fails every write with ENOSPC
    // (Wine reports no attributes for devices, so try to open it).
    int fd = platform::open_file("Z:/dev/full", true, false);
    if (fd >= 0) {
        platform::close_file(fd);
        expect_disk_full("Z:/dev/full", 1 << 20, "write to Z:/dev/full");
    } else {
        std::printf("skip: Z:/dev/full is not there (not Wine)\n");
    }
    if (small_volume.empty()) {
        std::printf("skip: no small volume given: a real full-disk write was not tested\n");
        return;
    }
    const std::string path = small_volume + "/fill";
    expect_disk_full(path, size_t(8) << 20, "8 MiB write to a small volume");
    platform::remove_path(path);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::printf("usage: test_windows <directory> [<directory on a small volume>]\n");
        return 2;
    }
    std::string dir;
    int rc = platform::make_temp_dir(argv[1], "deepoffload-win-", &dir);
    if (rc < 0) {
        std::printf("cannot create a temporary directory in %s: %s\n", argv[1], platform::errno_text(-rc).c_str());
        return 2;
    }
    std::vector<std::string> engines = compiled_engines();
    check(engines.size() == 1 && engines[0] == "windows" && HandleConfig().engine == "windows",
          "the Windows build has the windows engine only, and it is the default");
    test_error_text(dir);
    test_open_modes(dir);
    test_engine_direct(dir);
    test_disk_full(argc > 2 ? argv[2] : "");
    rc = platform::remove_path(dir);
    check(rc == 0, "temporary directory removed: " + (rc < 0 ? platform::errno_text(-rc) : std::string()));
    return report();
}
