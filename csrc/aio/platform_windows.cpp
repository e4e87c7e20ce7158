// Windows implementation of platform.h (and of platform_windows.h).
//
// Descriptors are C runtime descriptors wrapping Win32 HANDLEs, so a descriptor
// from Python's os.open works too. Files we open are overlapped, shareable
// (read, write, delete) and bound to one process-wide completion port; "direct"
// means FILE_FLAG_NO_BUFFERING, whose alignment is the volume's sector size.
// Errors are Win32 codes mapped to the nearest errno; the code and its system
// message are remembered per thread and appended by errno_text().
#if defined(_WIN32)

#include "platform.h"
#include "platform_windows.h"

#include <io.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace deepoffload {
namespace platform {

namespace {

// errno values that some C runtimes lack; Python's errno module uses the same numbers on Windows.
#ifndef ENODATA
#define ENODATA 120
#endif
#ifndef ECANCELED
#define ECANCELED 105
#endif
#ifndef EOPNOTSUPP
#define EOPNOTSUPP 130
#endif
// Win32 codes that older SDK headers lack.
#ifndef ERROR_OFFSET_ALIGNMENT_VIOLATION
#define ERROR_OFFSET_ALIGNMENT_VIOLATION 327L
#endif
#ifndef ERROR_DISK_QUOTA_EXCEEDED
#define ERROR_DISK_QUOTA_EXCEEDED 1295L
#endif

constexpr size_t kLockMinBytes = size_t(1) << 20;  // VirtualLock only blocks the heap maps on their own
constexpr DWORD kMaxChunk = DWORD(1) << 30;        // bytes per ReadFile/WriteFile call

thread_local DWORD t_win_code = 0;  // last Win32 code mapped on this thread
thread_local int t_win_errno = 0;   // ... and the errno it was mapped to

struct FileEntry {
    bool direct = false;  // opened with FILE_FLAG_NO_BUFFERING
    bool bound = false;   // bound to completion_port()
};

std::mutex g_files_mutex;
std::unordered_map<int, FileEntry> g_files;  // descriptors opened by open_file / reopen_buffered

#if defined(_MSC_VER)
// The CRT calls an "invalid parameter" handler (by default: terminate) for a bad
// descriptor; silence it on this thread for the duration of one CRT call, as CPython does.
void ignore_invalid_parameter(const wchar_t*, const wchar_t*, const wchar_t*, unsigned, uintptr_t) {}
struct QuietCrt {
    _invalid_parameter_handler old = _set_thread_local_invalid_parameter_handler(ignore_invalid_parameter);
    ~QuietCrt() { _set_thread_local_invalid_parameter_handler(old); }
};
#else
struct QuietCrt {  // MinGW's msvcrt returns -1/EBADF without calling a handler
    ~QuietCrt() {}
};
#endif

int map_win32(DWORD code) {
    switch (code) {
        case ERROR_FILE_NOT_FOUND:
        case ERROR_PATH_NOT_FOUND:
        case ERROR_INVALID_DRIVE:
        case ERROR_BAD_NETPATH:
        case ERROR_BAD_NET_NAME:
        case ERROR_INVALID_NAME:
        case ERROR_BAD_PATHNAME:
            return ENOENT;
        case ERROR_TOO_MANY_OPEN_FILES: return EMFILE;
        case ERROR_ACCESS_DENIED:
        case ERROR_SHARING_VIOLATION:
        case ERROR_LOCK_VIOLATION:
        case ERROR_NETWORK_ACCESS_DENIED:
            return EACCES;
        case ERROR_WRITE_PROTECT: return EROFS;
        case ERROR_INVALID_HANDLE: return EBADF;
        case ERROR_NOT_ENOUGH_MEMORY:
        case ERROR_OUTOFMEMORY:
        case ERROR_NO_SYSTEM_RESOURCES:
        case ERROR_NONPAGED_SYSTEM_RESOURCES:
        case ERROR_PAGED_SYSTEM_RESOURCES:
        case ERROR_WORKING_SET_QUOTA:
        case ERROR_NOT_ENOUGH_QUOTA:
            return ENOMEM;
        case ERROR_INVALID_PARAMETER:
        case ERROR_INVALID_FUNCTION:
        case ERROR_NEGATIVE_SEEK:
        case ERROR_INVALID_USER_BUFFER:
        case ERROR_OFFSET_ALIGNMENT_VIOLATION:
            return EINVAL;
        case ERROR_NOT_SUPPORTED:
        case ERROR_CALL_NOT_IMPLEMENTED:
            return EOPNOTSUPP;
        case ERROR_HANDLE_DISK_FULL:
        case ERROR_DISK_FULL:
        case ERROR_DISK_QUOTA_EXCEEDED:
            return ENOSPC;
        case ERROR_FILE_EXISTS:
        case ERROR_ALREADY_EXISTS:
            return EEXIST;
        case ERROR_DIRECTORY: return ENOTDIR;
        case ERROR_DIR_NOT_EMPTY: return ENOTEMPTY;
        case ERROR_HANDLE_EOF: return ENODATA;
        case ERROR_OPERATION_ABORTED: return ECANCELED;
        case ERROR_FILE_TOO_LARGE: return EFBIG;
        case ERROR_BUSY:
        case ERROR_PIPE_BUSY:
            return EBUSY;
        case ERROR_NOACCESS: return EFAULT;
        default: return EIO;  // ERROR_CRC, ERROR_IO_DEVICE, ERROR_GEN_FAILURE, ...
    }
}

struct ErrnoInfo {
    int err;
    const char* name;
    const char* text;
};

// The C runtime's strerror() on Windows knows only a few of these, so name them here.
constexpr ErrnoInfo kErrnoInfo[] = {
    {EPERM, "EPERM", "Operation not permitted"},
    {ENOENT, "ENOENT", "No such file or directory"},
    {EINTR, "EINTR", "Interrupted function call"},
    {EIO, "EIO", "Input/output error"},
    {EBADF, "EBADF", "Bad file descriptor"},
    {EAGAIN, "EAGAIN", "Resource temporarily unavailable"},
    {ENOMEM, "ENOMEM", "Not enough memory"},
    {EACCES, "EACCES", "Permission denied"},
    {EFAULT, "EFAULT", "Bad address"},
    {EBUSY, "EBUSY", "Resource busy"},
    {EEXIST, "EEXIST", "File exists"},
    {ENOTDIR, "ENOTDIR", "Not a directory"},
    {EISDIR, "EISDIR", "Is a directory"},
    {EINVAL, "EINVAL", "Invalid argument"},
    {EMFILE, "EMFILE", "Too many open files"},
    {EFBIG, "EFBIG", "File too large"},
    {ENOSPC, "ENOSPC", "No space left on device"},
    {EROFS, "EROFS", "Read-only file system"},
    {ENOSYS, "ENOSYS", "Function not implemented"},
    {ENOTEMPTY, "ENOTEMPTY", "Directory not empty"},
    {ENODATA, "ENODATA", "No data available"},
    {ECANCELED, "ECANCELED", "Operation canceled"},
    {EOPNOTSUPP, "EOPNOTSUPP", "Operation not supported"},
};

std::string win32_message(DWORD code) {
    char* text = nullptr;
    DWORD n = FormatMessageA(FORMAT_MESSAGE_ALLOCATE_BUFFER | FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS,
                             nullptr, code, 0, reinterpret_cast<char*>(&text), 0, nullptr);
    std::string s = n > 0 && text != nullptr ? std::string(text, n) : "unknown error";
    LocalFree(text);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '.')) s.pop_back();
    return s;
}

// UTF-8 -> UTF-16; false when `in` is not valid UTF-8.
bool widen(const std::string& in, std::wstring* out) {
    out->clear();
    if (in.empty()) return true;
    int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, in.data(), static_cast<int>(in.size()), nullptr, 0);
    if (n <= 0) return false;
    out->resize(static_cast<size_t>(n));
    return MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, in.data(), static_cast<int>(in.size()), &(*out)[0], n) ==
           n;
}

bool is_directory(const std::wstring& path) {
    DWORD attrs = GetFileAttributesW(path.c_str());
    return attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_DIRECTORY) != 0;
}

DWORD access_for(bool write) {
    // FILE_READ_ATTRIBUTES: file_size() and the alignment query work on write handles too.
    return (write ? GENERIC_WRITE : GENERIC_READ) | FILE_READ_ATTRIBUTES;
}

constexpr DWORD kShareAll = FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE;

// Binds `h` to the completion port, wraps it in a C runtime descriptor and records it.
// Takes ownership of `h`. Returns the descriptor or -errno.
int adopt_handle(HANDLE h, bool direct) {
    HANDLE port = windows::completion_port();
    const bool bound = port != nullptr && CreateIoCompletionPort(h, port, 0, 0) != nullptr;
    int fd;
    {
        QuietCrt quiet;
        fd = _open_osfhandle(reinterpret_cast<intptr_t>(h), 0);
    }
    if (fd < 0) {
        CloseHandle(h);
        return -EMFILE;
    }
    std::lock_guard<std::mutex> lock(g_files_mutex);
    FileEntry& e = g_files[fd];
    e.direct = direct;
    e.bound = bound;
    return fd;
}

// Waits for the overlapped transfer started on `h` (any kind of handle) and returns its byte count or -errno;
// 0 at end of file.
int64_t finish_transfer(HANDLE h, BOOL started, OVERLAPPED* ov) {
    DWORD n = 0;
    if (!started) {
        DWORD code = GetLastError();
        if (code == ERROR_HANDLE_EOF) return 0;
        if (code != ERROR_IO_PENDING) return windows::from_win32(code);
    }
    if (!GetOverlappedResult(h, ov, &n, TRUE)) {
        DWORD code = GetLastError();
        if (code == ERROR_HANDLE_EOF) return 0;
        return windows::from_win32(code);
    }
    return static_cast<int64_t>(n);
}

// A per-thread event for synchronous transfers. Its low bit is set in OVERLAPPED.hEvent,
// which tells Windows not to post a completion packet for that transfer.
HANDLE sync_event() {
    struct Event {
        HANDLE h = CreateEventW(nullptr, TRUE, FALSE, nullptr);
        ~Event() {
            if (h != nullptr) CloseHandle(h);
        }
    };
    thread_local Event event;
    return event.h;
}

int64_t transfer_full(int fd, char* p, size_t len, int64_t offset, bool write) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    HANDLE event = sync_event();
    if (event == nullptr) return windows::from_win32(GetLastError());
    size_t done = 0;
    while (done < len) {
        const DWORD chunk = static_cast<DWORD>(std::min<size_t>(len - done, kMaxChunk));
        const uint64_t at = static_cast<uint64_t>(offset) + done;
        OVERLAPPED ov;
        std::memset(&ov, 0, sizeof(ov));
        ov.Offset = static_cast<DWORD>(at & 0xffffffffu);
        ov.OffsetHigh = static_cast<DWORD>(at >> 32);
        ov.hEvent = reinterpret_cast<HANDLE>(reinterpret_cast<uintptr_t>(event) | 1);
        BOOL started = write ? WriteFile(h, p + done, chunk, nullptr, &ov) : ReadFile(h, p + done, chunk, nullptr, &ov);
        int64_t n = finish_transfer(h, started, &ov);
        if (n < 0) return n;
        if (n == 0) {
            if (write) return -EIO;  // a write that makes no progress would loop forever
            break;                   // end of file
        }
        done += static_cast<size_t>(n);
    }
    return static_cast<int64_t>(done);
}

std::string random_suffix() {
    static std::atomic<uint64_t> counter{0};
    uint64_t x = (uint64_t(GetCurrentProcessId()) << 32) ^ GetTickCount64() ^ (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    const char* digits = "abcdefghijklmnopqrstuvwxyz0123456789";
    std::string s;
    for (int i = 0; i < 6; ++i, x /= 36) s += digits[x % 36];
    return s;
}

// Calls create(path) with fresh random names until one does not exist yet.
template <typename Create>
int make_unique(const std::string& dir, const std::string& prefix, std::string* path_out, Create create) {
    for (int attempt = 0; attempt < 100; ++attempt) {
        std::string path = dir + "/" + prefix + random_suffix();
        std::wstring w;
        if (!widen(path, &w)) return -EINVAL;
        if (create(w)) {
            *path_out = path;
            return 0;
        }
        DWORD code = GetLastError();
        if (code != ERROR_FILE_EXISTS && code != ERROR_ALREADY_EXISTS) return windows::from_win32(code);
    }
    return -EEXIST;
}

}  // namespace

namespace windows {

HANDLE os_handle(int fd) {
    if (fd < 0) return INVALID_HANDLE_VALUE;
    QuietCrt quiet;
    intptr_t h = _get_osfhandle(fd);
    return h == -1 || h == -2 ? INVALID_HANDLE_VALUE : reinterpret_cast<HANDLE>(h);
}

bool bound_to_port(int fd) {
    std::lock_guard<std::mutex> lock(g_files_mutex);
    auto it = g_files.find(fd);
    return it != g_files.end() && it->second.bound;
}

HANDLE completion_port() {
    // Created once and kept for the life of the process (its dispatcher thread never exits).
    static HANDLE port = CreateIoCompletionPort(INVALID_HANDLE_VALUE, nullptr, 0, 1);
    return port;
}

int from_win32(DWORD code) {
    const int err = map_win32(code);
    t_win_code = code;
    t_win_errno = err;
    return -err;
}

}  // namespace windows

int open_file(const std::string& path, bool write, bool direct) {
    std::wstring w;
    if (!widen(path, &w)) return -EINVAL;
    const DWORD flags = FILE_ATTRIBUTE_NORMAL | FILE_FLAG_OVERLAPPED | (direct ? FILE_FLAG_NO_BUFFERING : 0);
    HANDLE h = CreateFileW(w.c_str(), access_for(write), kShareAll, nullptr, write ? OPEN_ALWAYS : OPEN_EXISTING,
                           flags, nullptr);
    if (h == INVALID_HANDLE_VALUE) {
        DWORD code = GetLastError();
        int rc = windows::from_win32(code);
        // Windows refuses to open a directory as a file with "access denied"; say what POSIX says.
        return code == ERROR_ACCESS_DENIED && is_directory(w) ? -EISDIR : rc;
    }
    return adopt_handle(h, direct);
}

int reopen_buffered(int fd, bool write) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    HANDLE h2 = ReOpenFile(h, access_for(write), kShareAll, FILE_FLAG_OVERLAPPED);
    if (h2 == INVALID_HANDLE_VALUE) return windows::from_win32(GetLastError());
    return adopt_handle(h2, false);
}

int close_file(int fd) {
    {
        std::lock_guard<std::mutex> lock(g_files_mutex);
        g_files.erase(fd);
    }
    QuietCrt quiet;
    if (_close(fd) != 0) return -(errno != 0 ? errno : EBADF);
    return 0;
}

int64_t pread_full(int fd, void* buf, size_t len, int64_t offset) {
    return transfer_full(fd, static_cast<char*>(buf), len, offset, false);
}

int64_t pwrite_full(int fd, const void* buf, size_t len, int64_t offset) {
    // WriteFile takes a const buffer; transfer_full only passes it through.
    return transfer_full(fd, const_cast<char*>(static_cast<const char*>(buf)), len, offset, true);
}

void* aligned_alloc_bytes(size_t alignment, size_t size) {
    if (alignment < sizeof(void*)) alignment = sizeof(void*);
    void* p = _aligned_malloc(size == 0 ? alignment : size, alignment);
    // Large blocks get their own virtual allocation from the heap, so locking them
    // pins only this buffer and freeing releases the lock. Best effort: a full
    // working-set quota (ERROR_WORKING_SET_QUOTA) leaves the buffer unlocked.
    if (p != nullptr && size >= kLockMinBytes) VirtualLock(p, size);
    return p;
}

void aligned_free(void* p) { _aligned_free(p); }

DioAlignment query_dio_alignment(int fd) {
    DioAlignment a;
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return a;
    DWORD sector = 0;
    FILE_STORAGE_INFO info;
    if (GetFileInformationByHandleEx(h, FileStorageInfo, &info, sizeof(info))) {
        sector = std::max(info.LogicalBytesPerSector, info.PhysicalBytesPerSectorForPerformance);
    } else {
        // Older systems: the sector size of the volume that holds the file.
        wchar_t name[MAX_PATH + 1], volume[MAX_PATH + 1];
        DWORD n = GetFinalPathNameByHandleW(h, name, MAX_PATH, FILE_NAME_NORMALIZED | VOLUME_NAME_DOS);
        DWORD sectors_per_cluster, bytes_per_sector, free_clusters, clusters;
        if (n > 0 && n < MAX_PATH && GetVolumePathNameW(name, volume, MAX_PATH) &&
            GetDiskFreeSpaceW(volume, &sectors_per_cluster, &bytes_per_sector, &free_clusters, &clusters)) {
            sector = bytes_per_sector;
        }
    }
    if (sector != 0 && (sector & (sector - 1)) == 0) {
        a.known = true;
        a.memory = sector;
        a.offset = sector;
    }
    return a;
}

int fd_is_direct(int fd) {
    {
        std::lock_guard<std::mutex> lock(g_files_mutex);
        auto it = g_files.find(fd);
        if (it != g_files.end()) return it->second.direct ? 1 : 0;
    }
    // A descriptor from elsewhere (the C runtime cannot open unbuffered files): buffered.
    return windows::os_handle(fd) == INVALID_HANDLE_VALUE ? -EBADF : 0;
}

int truncate_fd(int fd, int64_t size) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    FILE_END_OF_FILE_INFO info;
    info.EndOfFile.QuadPart = size;
    if (!SetFileInformationByHandle(h, FileEndOfFileInfo, &info, sizeof(info))) {
        return windows::from_win32(GetLastError());
    }
    return 0;
}

// Windows has no atomic grow-only call: writes extend the file themselves.
int grow_file(int, int64_t, int64_t) { return -EOPNOTSUPP; }

int sync_data(int fd) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    if (!FlushFileBuffers(h)) return windows::from_win32(GetLastError());
    return 0;
}

int64_t file_size(int fd) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    LARGE_INTEGER size;
    if (!GetFileSizeEx(h, &size)) return windows::from_win32(GetLastError());
    return static_cast<int64_t>(size.QuadPart);
}

int is_regular_file(int fd) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    DWORD type = GetFileType(h);
    if (type == FILE_TYPE_UNKNOWN && GetLastError() != NO_ERROR) return windows::from_win32(GetLastError());
    return type == FILE_TYPE_DISK ? 1 : 0;
}

int file_type(int fd) {
    HANDLE h = windows::os_handle(fd);
    if (h == INVALID_HANDLE_VALUE) return -EBADF;
    DWORD type = GetFileType(h);
    if (type == FILE_TYPE_UNKNOWN && GetLastError() != NO_ERROR) return windows::from_win32(GetLastError());
    if (type == FILE_TYPE_DISK) return kRegularFile;
    if (type == FILE_TYPE_CHAR) return kCharDevice;  // NUL, a console
    return kStream;                                   // a pipe or a socket
}

int probe_writable(void* p, size_t len) {
    const char* at = static_cast<const char*>(p);
    const char* end = at + len;
    while (at < end) {
        MEMORY_BASIC_INFORMATION info;
        if (VirtualQuery(at, &info, sizeof(info)) == 0) return 0;  // cannot tell
        const DWORD writable = PAGE_READWRITE | PAGE_WRITECOPY | PAGE_EXECUTE_READWRITE | PAGE_EXECUTE_WRITECOPY;
        if (info.State != MEM_COMMIT || (info.Protect & writable) == 0 || (info.Protect & PAGE_GUARD) != 0) {
            return -EFAULT;
        }
        at = static_cast<const char*>(info.BaseAddress) + info.RegionSize;
    }
    return 0;
}

int path_kind(const std::string& path) {
    std::wstring w;
    if (!widen(path, &w)) return -EINVAL;
    DWORD attrs = GetFileAttributesW(w.c_str());
    if (attrs == INVALID_FILE_ATTRIBUTES) return windows::from_win32(GetLastError());
    return (attrs & FILE_ATTRIBUTE_DIRECTORY) ? 1 : 2;
}

int make_temp_file(const std::string& dir, const std::string& prefix, std::string* path_out) {
    return make_unique(dir, prefix, path_out, [](const std::wstring& w) {
        HANDLE h = CreateFileW(w.c_str(), GENERIC_WRITE, kShareAll, nullptr, CREATE_NEW, FILE_ATTRIBUTE_NORMAL, nullptr);
        if (h == INVALID_HANDLE_VALUE) return false;
        CloseHandle(h);
        return true;
    });
}

int make_temp_dir(const std::string& dir, const std::string& prefix, std::string* path_out) {
    return make_unique(dir, prefix, path_out,
                       [](const std::wstring& w) { return CreateDirectoryW(w.c_str(), nullptr) != 0; });
}

int remove_path(const std::string& path) {
    std::wstring w;
    if (!widen(path, &w)) return -EINVAL;
    BOOL ok = is_directory(w) ? RemoveDirectoryW(w.c_str()) : DeleteFileW(w.c_str());
    return ok ? 0 : windows::from_win32(GetLastError());
}

// Windows delivers no asynchronous signals to worker threads (Ctrl+C runs a handler on a new thread).
void block_signals_in_this_thread() {}

std::string errno_text(int err) {
    std::string text;
    for (const ErrnoInfo& info : kErrnoInfo) {
        if (info.err == err) text = std::string(info.text) + " (" + info.name + ")";
    }
    if (text.empty()) text = "errno " + std::to_string(err);
    if (t_win_errno == err && t_win_code != 0) {
        text += " [Windows error " + std::to_string(t_win_code) + ": " + win32_message(t_win_code) + "]";
    }
    return text;
}

}  // namespace platform
}  // namespace deepoffload

#endif  // _WIN32
