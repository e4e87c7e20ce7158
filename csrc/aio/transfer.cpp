// The bytes of one op: opening its files (descriptor ownership, the O_DIRECT fallback) and running its shards
// through the worker's engine, with unaligned pieces, short transfers and misaligned memory handled here once.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>

#include "expect.h"
#include "op.h"
#include "platform.h"

namespace deepoffload {

Worker::~Worker() { platform::aligned_free(bounce); }

bool Worker::ensure_bounce(size_t size, size_t align) {
    if (bounce != nullptr && bounce_size >= size && bounce_align >= align) return true;
    size_t new_size = std::max(size, bounce_size);
    size_t new_align = std::max(align, bounce_align);
    void* p = platform::aligned_alloc_bytes(new_align, new_size);
    if (p == nullptr) return false;
    platform::aligned_free(bounce);
    bounce = static_cast<char*>(p);
    bounce_size = new_size;
    bounce_align = new_align;
    return true;
}

namespace {

// -- opening ----------------------------------------------------------------------------------------------------

// The refusal of a FIFO, pipe or socket: they have no file offsets, and an
// engine's read of an empty pipe (or write to a full one) never completes.
OpFailure stream_failure(const Op& op) {
    return OpFailure(ESPIPE, "open", op.offset,
                     "'" + op.path + "' is a FIFO, pipe or socket: " + platform::errno_text(ESPIPE) +
                         "; deepoffload reads and writes at file offsets, so use a regular file or a block device");
}

OpFailure open_failure(const Op& op, int err) {
    return OpFailure(err, "open", op.offset,
                     "cannot open '" + op.path + "' for " + (op.write ? "writing" : "reading") + ": " +
                         platform::errno_text(err));
}

// A caller's descriptor is used as it is; an O_DIRECT one gets a buffered companion for the unaligned pieces.
void adopt_descriptor(Op& op, bool want_direct) {
    const int is_direct = platform::fd_is_direct(op.user_fd);
    DEEPOFFLOAD_EXPECT(is_direct >= 0, OpFailure(-is_direct, "open", op.offset,
                                                 "descriptor " + std::to_string(op.user_fd) + " for '" + op.path +
                                                     "' is not usable: " + platform::errno_text(-is_direct)));
    if (is_direct == 0) {
        op.io_fd = op.buffered_fd = op.user_fd;
        return;
    }
    const int bfd = platform::reopen_buffered(op.user_fd, op.write);
    DEEPOFFLOAD_EXPECT(bfd >= 0, OpFailure(-bfd, "open", op.offset,
                                           "cannot open a buffered descriptor next to O_DIRECT descriptor " +
                                               std::to_string(op.user_fd) + " for '" + op.path +
                                               "': " + platform::errno_text(-bfd)));
    op.buffered_fd = bfd;
    op.own_buffered_fd = true;
    op.io_fd = want_direct ? op.user_fd : bfd;
    op.direct = want_direct;
}

// A path is opened with O_DIRECT when asked for and the file system allows it (EINVAL: it refuses; the op goes
// buffered), and always once more without it for the unaligned pieces.
void open_path(Op& op, bool want_direct) {
    if (want_direct) {
        const int fd = platform::open_file(op.path, op.write, true);
        DEEPOFFLOAD_EXPECT(fd != -ESPIPE, stream_failure(op));
        DEEPOFFLOAD_EXPECT(fd >= 0 || fd == -EINVAL, open_failure(op, -fd));
        if (fd >= 0) {
            op.io_fd = fd;
            op.own_io_fd = true;
            op.direct = true;
        }
    }
    const int bfd = platform::open_file(op.path, op.write, false);
    DEEPOFFLOAD_EXPECT(bfd != -ESPIPE, stream_failure(op));
    DEEPOFFLOAD_EXPECT(bfd >= 0, open_failure(op, -bfd));
    op.buffered_fd = bfd;
    op.own_buffered_fd = true;
    if (!op.direct) op.io_fd = bfd;
}

// The op continues without O_DIRECT: a direct descriptor it opened is closed.
void drop_direct(Op& op) {
    if (op.direct && op.own_io_fd) platform::close_file(op.io_fd);
    op.own_io_fd = false;
    op.io_fd = op.buffered_fd;
    op.direct = false;
}

// Extending direct writes are serialized by some file systems (ext4 waits for
// each one): allocate the range first so the requests land inside the file.
// fallocate never shortens the file, so writes to other parts of it running
// meanwhile keep their bytes (a size check followed by ftruncate could cut
// them). Where it is unsupported the writes extend the file themselves.
void allocate_range(Op& op) {
    if (!(op.write && op.direct && op.nbytes > 0 && platform::is_regular_file(op.buffered_fd) == 1)) return;
    const int64_t end = op.end();
    const int64_t size = platform::file_size(op.buffered_fd);
    const int rc = size < 0 ? static_cast<int>(size)
                            : (size < end ? platform::grow_file(op.buffered_fd, op.offset, end - op.offset) : 0);
    DEEPOFFLOAD_EXPECT(rc >= 0 || rc == -EOPNOTSUPP,
                       OpFailure(-rc, "write", op.offset,
                                 "cannot allocate bytes " + std::to_string(op.offset) + " to " + std::to_string(end) +
                                     " of '" + op.path + "' (fallocate): " + platform::errno_text(-rc)));
}

// -- transferring -----------------------------------------------------------------------------------------------

std::string describe(const Op& op, const char* what, size_t len, int64_t at, int err) {
    return std::string(what) + " of " + std::to_string(len) + " bytes at offset " + std::to_string(at) + " of '" +
           op.path + "' failed: " + platform::errno_text(err);
}

// Completes [buf, buf+len) at file offset `at` synchronously through the
// buffered descriptor (unaligned pieces, and the remainder of short transfers).
bool transfer_buffered(Op& op, char* buf, size_t len, int64_t at) {
    if (len == 0) return true;
    int64_t rc = op.write ? platform::pwrite_full(op.buffered_fd, buf, len, at)
                          : platform::pread_full(op.buffered_fd, buf, len, at);
    if (rc < 0) {
        op.fail(static_cast<int>(-rc), op.write ? "write" : "read", at,
                describe(op, op.write ? "write" : "read", len, at, static_cast<int>(-rc)));
        return false;
    }
    if (static_cast<size_t>(rc) < len) {  // only reads come back short: end of file
        int64_t size = platform::file_size(op.buffered_fd);
        int64_t want = op.offset + static_cast<int64_t>(op.nbytes);
        op.fail(ENODATA, "read", at + rc,
                "file '" + op.path + "' ends at byte " + std::to_string(size < 0 ? at + rc : size) +
                    ", before offset+len " + std::to_string(want));
        return false;
    }
    return true;
}

// Checks the engine's results; finishes short transfers synchronously.
bool settle_requests(Op& op, Request* requests, size_t n) {
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) {
        Request& b = requests[i];
        if (b.result < 0) {
            int err = static_cast<int>(-b.result);
            const char* operation = b.submit_failed ? "submit" : (op.write ? "write" : "read");
            op.fail(err, operation, b.offset, describe(op, operation, b.len, b.offset, err));
            ok = false;
        } else if (static_cast<size_t>(b.result) < b.len) {
            size_t got = static_cast<size_t>(b.result);
            ok = transfer_buffered(op, b.buf + got, b.len - got, b.offset + b.result);
        }
    }
    return ok;
}

// A memcpy on a helper thread, so a bounce copy overlaps the IO of the previous
// or next wave. Copies inline when no thread can be started. The destructor
// joins, so no exit path leaves the thread running (or a joinable std::thread).
class BackgroundCopy {
public:
    BackgroundCopy() = default;
    BackgroundCopy(const BackgroundCopy&) = delete;
    BackgroundCopy& operator=(const BackgroundCopy&) = delete;
    ~BackgroundCopy() { join(); }

    // With check_dst, first makes sure every page of dst is writable (a copy
    // into a read-only mapping would end the process); if not, copies nothing
    // and faulted() turns true.
    void start(char* dst, const char* src, size_t len, bool check_dst = false) {
        join();
        auto work = [this, dst, src, len, check_dst] {
            if (check_dst && platform::probe_writable(dst, len) < 0) {
                fault_.store(true);
                return;
            }
            std::memcpy(dst, src, len);
        };
        try {
            thread_ = std::thread(work);
        } catch (const std::system_error&) {
            work();
        }
    }
    void join() {
        if (thread_.joinable()) thread_.join();
    }
    bool faulted() const { return fault_.load(); }

private:
    std::thread thread_;
    std::atomic<bool> fault_{false};
};

// Misaligned user memory: stage [user, user+len) (file offset `at`) through the
// worker's aligned bounce buffer, split in two slots used in turn. While the
// engine transfers one slot, a helper thread copies the next wave into the
// other (writes) or the previous wave out of it (reads).
bool transfer_bounced(Worker& worker, Op& op, char* user, size_t len, int64_t at, size_t request_bytes,
                      int queue_depth) {
    const BouncePlan plan = plan_bounce(len, request_bytes, queue_depth, op.mem_align);
    const size_t half = plan.slot_bytes;
    if (!worker.ensure_bounce(plan.total(), plan.alignment)) {
        op.fail(ENOMEM, op.write ? "write" : "read", at,
                "cannot allocate a " + std::to_string(plan.total()) + "-byte bounce buffer");
        return false;
    }
    char* slot[2] = {worker.bounce, worker.bounce + (plan.slots - 1) * half};
    const size_t waves = (len + half - 1) / half;
    auto wave_len = [&](size_t i) { return std::min(half, len - i * half); };
    BackgroundCopy copy;
    if (op.write) std::memcpy(slot[0], user, wave_len(0));
    for (size_t i = 0; i < waves; ++i) {
        if (op.failed.load()) return false;
        char* buf = slot[i % 2];
        const size_t n = wave_len(i);
        if (op.write && i + 1 < waves) copy.start(slot[(i + 1) % 2], user + (i + 1) * half, wave_len(i + 1));
        split_into_requests(&worker.requests, op.io_fd, op.write, buf, n, at + static_cast<int64_t>(i * half),
                            request_bytes);
        worker.engine->run(worker.requests.data(), worker.requests.size());
        copy.join();  // the other slot is free again
        if (copy.faulted()) break;
        if (!settle_requests(op, worker.requests.data(), worker.requests.size())) return false;
        if (!op.write) copy.start(user + i * half, buf, n, true);  // overlaps the next wave's IO
    }
    copy.join();
    if (copy.faulted()) {
        op.fail(EFAULT, "read", at,
                "read of " + std::to_string(len) + " bytes at offset " + std::to_string(at) + " of '" + op.path +
                    "' failed: the destination memory is not writable (a read-only mapping?): " +
                    platform::errno_text(EFAULT));
        return false;
    }
    return true;
}

}  // namespace

void open_files(Op& op) {
    const bool want_direct = (op.flags & kFlagBuffered) == 0;
    if (op.user_fd >= 0) {
        adopt_descriptor(op, want_direct);
    } else {
        open_path(op, want_direct);
    }
    // Non-regular files never reach an engine that could block on them forever.
    const int type = platform::file_type(op.buffered_fd);
    DEEPOFFLOAD_EXPECT(type != platform::kStream, stream_failure(op));
    op.regular = type == platform::kRegularFile;
    if (type == platform::kCharDevice) {
        op.sync_only = true;
        drop_direct(op);
    }
    if (op.direct) {
        platform::DioAlignment a = platform::query_dio_alignment(op.io_fd);
        if (a.known && !a.supported) {
            drop_direct(op);
        } else {
            op.mem_align = a.memory;
            op.off_align = direct_offset_alignment(a.offset);
        }
    }
    op.result.direct = op.direct;
    allocate_range(op);
}

void run_shard(Worker& worker, Op& op, const Span& shard, const EngineConfig& config) {
    if (op.failed.load()) return;
    const int64_t b = shard.begin;
    const int64_t e = shard.end;
    auto mem = [&op](int64_t file_offset) { return op.buf + (file_offset - op.offset); };  // user memory of a byte
    if (op.sync_only) {
        transfer_buffered(op, mem(b), static_cast<size_t>(e - b), b);
        return;
    }
    const Span mid = aligned_middle(shard, op.off_align);

    // Unaligned head, synchronously through the buffered descriptor.
    if (!transfer_buffered(op, mem(b), static_cast<size_t>(mid.begin - b), b)) return;

    if (mid.size() > 0) {
        const size_t request_bytes = request_size(config.block_size, op.direct, op.off_align, op.mem_align);
        char* user = mem(mid.begin);
        const size_t len = static_cast<size_t>(mid.size());
        if (!needs_bounce(op.direct, user, op.mem_align)) {
            // Fast path: the engine works on the caller's memory.
            split_into_requests(&worker.requests, op.io_fd, op.write, user, len, mid.begin, request_bytes);
            worker.engine->run(worker.requests.data(), worker.requests.size());
            if (!settle_requests(op, worker.requests.data(), worker.requests.size())) return;
        } else if (!transfer_bounced(worker, op, user, len, mid.begin, request_bytes, config.queue_depth)) {
            return;
        }
    }

    // Unaligned tail.
    transfer_buffered(op, mem(mid.end), static_cast<size_t>(e - mid.end), mid.end);
}

}  // namespace deepoffload
