// POSIX (Linux) implementation of platform.h.
#if !defined(_WIN32)

#include "platform.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/types.h>
#include <unistd.h>

namespace deepoffload {
namespace platform {

namespace {

// Layout of the kernel's struct statx (include/uapi/linux/stat.h). Defined
// here because older glibc headers lack the direct-IO alignment fields.
struct KernelStatxTimestamp {
    int64_t tv_sec;
    uint32_t tv_nsec;
    int32_t reserved;
};

struct KernelStatx {
    uint32_t mask;
    uint32_t blksize;
    uint64_t attributes;
    uint32_t nlink;
    uint32_t uid;
    uint32_t gid;
    uint16_t mode;
    uint16_t spare0;
    uint64_t ino;
    uint64_t size;
    uint64_t blocks;
    uint64_t attributes_mask;
    KernelStatxTimestamp atime, btime, ctime, mtime;
    uint32_t rdev_major, rdev_minor, dev_major, dev_minor;
    uint64_t mnt_id;
    uint32_t dio_mem_align;
    uint32_t dio_offset_align;
    uint64_t spare3[12];
};
static_assert(sizeof(KernelStatx) == 256, "struct statx layout");

constexpr unsigned kStatxDioAlign = 0x00002000U;  // STATX_DIOALIGN
#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

int open_flags(bool write, bool direct) {
    int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    flags |= O_CLOEXEC;
    if (direct) flags |= O_DIRECT;
    return flags;
}

// GNU and XSI strerror_r differ in return type; accept both.
[[maybe_unused]] const char* strerror_result(int rc, const char* buf) { return rc == 0 ? buf : "unknown error"; }
[[maybe_unused]] const char* strerror_result(const char* msg, const char*) { return msg; }

const char* errno_name(int err) {
    switch (err) {
        case EPERM: return "EPERM";
        case ENOENT: return "ENOENT";
        case ENXIO: return "ENXIO";
        case ESPIPE: return "ESPIPE";
        case EINTR: return "EINTR";
        case EIO: return "EIO";
        case EBADF: return "EBADF";
        case EAGAIN: return "EAGAIN";
        case ENOMEM: return "ENOMEM";
        case EACCES: return "EACCES";
        case EFAULT: return "EFAULT";
        case EBUSY: return "EBUSY";
        case EEXIST: return "EEXIST";
        case ENOTDIR: return "ENOTDIR";
        case EISDIR: return "EISDIR";
        case EINVAL: return "EINVAL";
        case EMFILE: return "EMFILE";
        case EFBIG: return "EFBIG";
        case ENOSPC: return "ENOSPC";
        case EROFS: return "EROFS";
        case ENOSYS: return "ENOSYS";
        case ENODATA: return "ENODATA";
        case EOPNOTSUPP: return "EOPNOTSUPP";
        case EDQUOT: return "EDQUOT";
        case ECANCELED: return "ECANCELED";
        default: return nullptr;
    }
}

}  // namespace

int open_file(const std::string& path, bool write, bool direct) {
    // O_NONBLOCK so that opening a FIFO returns at once instead of waiting for its other end; cleared again for
    // every other kind of file (io_uring would otherwise turn a busy regular-file transfer into EAGAIN).
    int fd;
    for (;;) {
        fd = ::open(path.c_str(), open_flags(write, direct) | O_NONBLOCK, 0644);
        if (fd >= 0) break;
        if (errno == EINTR) continue;
        const int err = errno;
        struct stat st;
        if (err == ENXIO && ::stat(path.c_str(), &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode))) {
            return -ESPIPE;  // a FIFO without a reader, or a socket: no file offsets
        }
        return -err;
    }
    const int type = file_type(fd);
    if (type == kStream) {
        ::close(fd);
        return -ESPIPE;
    }
    const int fl = ::fcntl(fd, F_GETFL);
    if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        const int err = errno;
        ::close(fd);
        return -err;
    }
    return fd;
}

int reopen_buffered(int fd, bool write) {
    char proc_path[64];
    std::snprintf(proc_path, sizeof(proc_path), "/proc/self/fd/%d", fd);
    return open_file(proc_path, write, false);
}

int close_file(int fd) {
    // Linux closes the descriptor even when close() reports EINTR: never retry.
    if (::close(fd) != 0 && errno != EINTR) return -errno;
    return 0;
}

int64_t pread_full(int fd, void* buf, size_t len, int64_t offset) {
    size_t done = 0;
    char* p = static_cast<char*>(buf);
    while (done < len) {
        ssize_t n = ::pread(fd, p + done, len - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
        if (n > 0) {
            done += static_cast<size_t>(n);
        } else if (n == 0) {
            break;  // end of file
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return static_cast<int64_t>(done);
}

int64_t pwrite_full(int fd, const void* buf, size_t len, int64_t offset) {
    size_t done = 0;
    const char* p = static_cast<const char*>(buf);
    while (done < len) {
        ssize_t n = ::pwrite(fd, p + done, len - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
        if (n > 0) {
            done += static_cast<size_t>(n);
        } else if (n == 0) {
            return -EIO;  // a write that makes no progress would loop forever
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return static_cast<int64_t>(done);
}

void* aligned_alloc_bytes(size_t alignment, size_t size) {
    if (alignment < sizeof(void*)) alignment = sizeof(void*);
    void* p = nullptr;
    if (::posix_memalign(&p, alignment, size == 0 ? alignment : size) != 0) return nullptr;
    return p;
}

void aligned_free(void* p) { std::free(p); }

DioAlignment query_dio_alignment(int fd) {
    DioAlignment a;
#ifdef SYS_statx
    KernelStatx st;
    std::memset(&st, 0, sizeof(st));
    long rc = ::syscall(SYS_statx, fd, "", AT_EMPTY_PATH, kStatxDioAlign, &st);
    if (rc == 0 && (st.mask & kStatxDioAlign)) {
        a.known = true;
        if (st.dio_mem_align == 0 || st.dio_offset_align == 0) {
            a.supported = false;
        } else {
            a.memory = st.dio_mem_align;
            a.offset = st.dio_offset_align;
        }
    }
#else
    (void)fd;
#endif
    return a;
}

int fd_is_direct(int fd) {
    int fl = ::fcntl(fd, F_GETFL);
    if (fl < 0) return -errno;
    return (fl & O_DIRECT) ? 1 : 0;
}

int truncate_fd(int fd, int64_t size) {
    for (;;) {
        if (::ftruncate(fd, static_cast<off_t>(size)) == 0) return 0;
        if (errno != EINTR) return -errno;
    }
}

int grow_file(int fd, int64_t offset, int64_t len) {
    for (;;) {
        if (::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(len)) == 0) return 0;
        if (errno == EINTR) continue;
        return (errno == ENOSYS || errno == EOPNOTSUPP) ? -EOPNOTSUPP : -errno;
    }
}

int sync_data(int fd) {
    for (;;) {
        if (::fdatasync(fd) == 0) return 0;
        if (errno != EINTR) return -errno;
    }
}

int64_t file_size(int fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0) return -errno;
    return static_cast<int64_t>(st.st_size);
}

int is_regular_file(int fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0) return -errno;
    return S_ISREG(st.st_mode) ? 1 : 0;
}

int file_type(int fd) {
    struct stat st;
    if (::fstat(fd, &st) != 0) return -errno;
    if (S_ISREG(st.st_mode)) return kRegularFile;
    if (S_ISBLK(st.st_mode)) return kBlockDevice;
    if (S_ISCHR(st.st_mode)) return kCharDevice;
    if (S_ISDIR(st.st_mode)) return kDirectory;
    return kStream;
}

int probe_writable(void* p, size_t len) {
    // readv from /dev/zero writes one byte at the start of each page through the kernel, which reports a page it
    // cannot write as a short count or EFAULT instead of a signal.
    static const int zero_fd = ::open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (zero_fd < 0 || len == 0) return 0;
    constexpr uintptr_t kPage = 4096;
    constexpr size_t kBatch = 1024;
    iovec iov[kBatch];
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    const uintptr_t end = begin + len;
    uintptr_t next = begin;
    while (next < end) {
        size_t n = 0;
        for (uintptr_t a = next; a < end && n < kBatch; a = (a / kPage + 1) * kPage) {
            iov[n].iov_base = reinterpret_cast<void*>(a);
            iov[n].iov_len = 1;
            ++n;
        }
        ssize_t rc = ::readv(zero_fd, iov, static_cast<int>(n));
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0) return errno == EFAULT ? -EFAULT : 0;
        if (rc == 0) return -EFAULT;
        // rc pages were written; continue from the first one that was not (it faults next time, or was cut short).
        const size_t written = static_cast<size_t>(rc);
        next = written < n ? reinterpret_cast<uintptr_t>(iov[written].iov_base)
                           : (reinterpret_cast<uintptr_t>(iov[n - 1].iov_base) / kPage + 1) * kPage;
    }
    return 0;
}

int path_kind(const std::string& path) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return -errno;
    return S_ISDIR(st.st_mode) ? 1 : 2;
}

int make_temp_file(const std::string& dir, const std::string& prefix, std::string* path_out) {
    std::string tmpl = dir + "/" + prefix + "XXXXXX";
    int fd = ::mkstemp(&tmpl[0]);
    if (fd < 0) return -errno;
    ::close(fd);
    *path_out = tmpl;
    return 0;
}

int make_temp_dir(const std::string& dir, const std::string& prefix, std::string* path_out) {
    std::string tmpl = dir + "/" + prefix + "XXXXXX";
    if (::mkdtemp(&tmpl[0]) == nullptr) return -errno;
    *path_out = tmpl;
    return 0;
}

int remove_path(const std::string& path) {
    if (::remove(path.c_str()) != 0) return -errno;
    return 0;
}

void block_signals_in_this_thread() {
    sigset_t all;
    sigfillset(&all);
    // Synchronous fault signals stay deliverable so crashes are still reported.
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
}

std::string errno_text(int err) {
    char buf[256];
    buf[0] = '\0';
    std::string text = strerror_result(::strerror_r(err, buf, sizeof(buf)), buf);
    const char* name = errno_name(err);
    if (name != nullptr) {
        text += " (";
        text += name;
        text += ")";
    } else {
        text += " (errno " + std::to_string(err) + ")";
    }
    return text;
}

}  // namespace platform
}  // namespace deepoffload

#endif  // !_WIN32
