// Operating-system layer: the only place that knows about POSIX file calls.
// Every function returns 0 / a byte count on success and -errno on failure;
// nothing here throws. A platform_windows.cpp can implement the same
// declarations without touching the rest of the core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace deepoffload {
namespace platform {

// Opens `path` for reading (O_RDONLY) or writing (O_WRONLY|O_CREAT, mode 0644,
// never O_TRUNC), optionally with O_DIRECT. Returns the descriptor or -errno.
// Never blocks on a FIFO: a FIFO or socket path returns -ESPIPE.
int open_file(const std::string& path, bool write, bool direct);

// Opens a second, buffered descriptor on the file behind `fd` (used when a
// caller hands us an O_DIRECT descriptor and unaligned pieces need buffered IO).
int reopen_buffered(int fd, bool write);

// Returns 0 or -errno.
int close_file(int fd);

// Reads/writes up to `len` bytes at `offset`, retrying EINTR and short
// transfers. Returns the bytes transferred (less than len only at end of file
// for reads) or -errno.
int64_t pread_full(int fd, void* buf, size_t len, int64_t offset);
int64_t pwrite_full(int fd, const void* buf, size_t len, int64_t offset);

// Aligned heap memory; returns nullptr on failure. `alignment` is a power of two.
void* aligned_alloc_bytes(size_t alignment, size_t size);
void aligned_free(void* p);

struct DioAlignment {
    size_t memory = 4096;   // required alignment of buffer addresses, bytes
    size_t offset = 4096;   // required alignment of file offsets and lengths, bytes
    bool known = false;     // true when the kernel reported the values
    bool supported = true;  // false when the kernel says direct IO is unsupported
};

// Queries the direct-IO alignment of an open file (statx STATX_DIOALIGN).
// Falls back to 4096/4096 with known=false when the kernel cannot tell.
DioAlignment query_dio_alignment(int fd);

// True when the descriptor was opened with O_DIRECT. Returns -errno on failure.
int fd_is_direct(int fd);

int truncate_fd(int fd, int64_t size);  // 0 or -errno
// Makes the file at least offset + len bytes long by allocating [offset, offset + len) in one atomic call that
// never shortens it (Linux fallocate mode 0), so concurrent writes to the file cannot lose bytes to a stale size.
// Returns 0, -EOPNOTSUPP where the file system (or platform) cannot, or another -errno (ENOSPC).
int grow_file(int fd, int64_t offset, int64_t len);
int sync_data(int fd);                  // fdatasync; 0 or -errno
int64_t file_size(int fd);              // size in bytes or -errno
int is_regular_file(int fd);            // 1 regular file, 0 other (device, pipe), -errno

// What kind of file a descriptor refers to (FileType) or -errno.
enum FileType : int {
    kRegularFile = 0,
    kBlockDevice = 1,
    kCharDevice = 2,  // /dev/null, /dev/zero, a console: no O_DIRECT, no size, may not support async IO
    kDirectory = 3,
    kStream = 4,      // FIFO, pipe or socket: no file offsets; a read or write may block forever
};
int file_type(int fd);

// 0 when every byte of [p, p+len) can be written, -EFAULT when some page cannot (a read-only mapping), found
// without touching the memory from user space (so no SIGSEGV). May overwrite the first byte of each page: use it
// only on memory that is about to be overwritten. Returns 0 when it cannot tell.
int probe_writable(void* p, size_t len);

// Path helpers (also used by the native tests).
int path_kind(const std::string& path);  // 1 = directory, 2 = other existing, -errno otherwise
// Creates a new empty file named <dir>/<prefix>XXXXXX; returns 0 or -errno.
int make_temp_file(const std::string& dir, const std::string& prefix, std::string* path_out);
int make_temp_dir(const std::string& dir, const std::string& prefix, std::string* path_out);
int remove_path(const std::string& path);  // file or empty directory; 0 or -errno

// Blocks asynchronous signals in the calling thread so worker threads never
// run signal handlers (the interpreter's main thread handles them).
void block_signals_in_this_thread();

// Human-readable text for an errno value, e.g. "No such file or directory (ENOENT)".
std::string errno_text(int err);

}  // namespace platform
}  // namespace deepoffload
