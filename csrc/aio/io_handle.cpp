#include "io_handle.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "platform.h"

namespace deepoffload {

namespace {

constexpr size_t kMaxBlockSize = size_t(1) << 30;
constexpr int kMaxQueueDepth = 32768;
constexpr int kMaxThreads = 256;
constexpr size_t kMaxBounceBytes = size_t(32) << 20;  // per worker thread
constexpr size_t kShardUnit = 4096;                   // shards are cut at multiples of this (or of the alignment)
// Direct IO covers whole pages only, even where the kernel accepts 512-byte offsets: a buffered write into a page
// that a concurrent direct write also covers can write the page's stale bytes back over the direct write.
constexpr size_t kPageSize = 4096;

int64_t round_down(int64_t v, int64_t a) { return v - (v % a); }
int64_t round_up(int64_t v, int64_t a) { return round_down(v + a - 1, a); }

std::string list_names(const std::vector<std::string>& names) {
    std::string s = "[";
    for (size_t i = 0; i < names.size(); ++i) {
        if (i) s += ", ";
        s += "'" + names[i] + "'";
    }
    return s + "]";
}

}  // namespace

// One queued read or write.
struct Op {
    bool write = false;
    char* buf = nullptr;
    size_t nbytes = 0;
    std::string path;
    int user_fd = -1;
    int64_t offset = 0;
    unsigned flags = 0;

    // Set by IoHandle::prepare.
    int io_fd = -1;        // descriptor for the aligned middle (O_DIRECT when direct)
    int buffered_fd = -1;  // descriptor for unaligned pieces and retries
    bool own_io_fd = false;
    bool own_buffered_fd = false;
    bool direct = false;
    bool regular = true;     // a regular file (else a device): only regular files are truncated
    bool sync_only = false;  // a character device: plain pread/pwrite on this thread, never an engine
    size_t mem_align = 1;
    size_t off_align = 1;
    std::vector<std::pair<int64_t, int64_t>> shards;  // [begin, end) file offsets
    std::atomic<int> shards_left{0};

    std::atomic<bool> failed{false};
    std::mutex result_mutex;
    OpResult result;
    bool done = false;     // guarded by IoHandle::mutex_
    int64_t keep_end = 0;  // kFlagTruncate: furthest end of writes to the same file that ran alongside this one
                           // (guarded by IoHandle::mutex_)

    int64_t end() const { return offset + static_cast<int64_t>(nbytes); }
    bool truncating() const { return write && (flags & kFlagTruncate) != 0; }

    void fail(int err, const char* operation, int64_t at, const std::string& detail) {
        std::lock_guard<std::mutex> lock(result_mutex);
        if (result.err == 0) {
            result.err = err;
            result.operation = operation;
            result.offset = at;
            result.detail = detail;
        }
        failed.store(true);
    }
};

// Per-thread state: an engine instance and a reusable aligned bounce buffer.
struct Worker {
    std::unique_ptr<Engine> engine;
    char* bounce = nullptr;
    size_t bounce_size = 0;
    size_t bounce_align = 0;
    std::vector<Block> blocks;

    ~Worker() { platform::aligned_free(bounce); }

    // Makes the bounce buffer at least `size` bytes aligned to `align`; grows only.
    bool ensure_bounce(size_t size, size_t align) {
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
};

namespace {

std::string describe(const Op& op, const char* what, size_t len, int64_t at, int err) {
    return std::string(what) + " of " + std::to_string(len) + " bytes at offset " + std::to_string(at) + " of '" +
           op.path + "' failed: " + platform::errno_text(err);
}

// The refusal of a FIFO, pipe or socket: they have no file offsets, and an
// engine's read of an empty pipe (or write to a full one) never completes.
void fail_stream(Op& op) {
    op.fail(ESPIPE, "open", op.offset,
            "'" + op.path + "' is a FIFO, pipe or socket: " + platform::errno_text(ESPIPE) +
                "; deepoffload reads and writes at file offsets, so use a regular file or a block device");
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
bool settle_blocks(Op& op, Block* blocks, size_t n) {
    bool ok = true;
    for (size_t i = 0; i < n && ok; ++i) {
        Block& b = blocks[i];
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

// Fills `out` with blocks of at most `block` bytes covering [buf, buf+len) at file offset `at`.
void make_blocks(std::vector<Block>* out, int fd, bool write, char* buf, size_t len, int64_t at, size_t block) {
    out->clear();
    for (size_t done = 0; done < len; done += block) {
        Block b;
        b.fd = fd;
        b.write = write;
        b.buf = buf + done;
        b.len = std::min(block, len - done);
        b.offset = at + static_cast<int64_t>(done);
        out->push_back(b);
    }
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

}  // namespace

IoHandle::IoHandle(const HandleConfig& config) : config_(config) {
    std::vector<std::string> names = compiled_engines();
    if (std::find(names.begin(), names.end(), config.engine) == names.end()) {
        throw std::invalid_argument("engine must be one of " + list_names(names) + ", got '" + config.engine + "'");
    }
    if (config.block_size < 4096 || config.block_size > kMaxBlockSize) {
        throw std::invalid_argument("block_size must be between 4096 and " + std::to_string(kMaxBlockSize) +
                                    " bytes, got " + std::to_string(config.block_size));
    }
    if (config.queue_depth < 1 || config.queue_depth > kMaxQueueDepth) {
        throw std::invalid_argument("queue_depth must be between 1 and " + std::to_string(kMaxQueueDepth) +
                                    ", got " + std::to_string(config.queue_depth));
    }
    if (config.threads < 1 || config.threads > kMaxThreads) {
        throw std::invalid_argument("threads must be between 1 and " + std::to_string(kMaxThreads) + ", got " +
                                    std::to_string(config.threads));
    }
    const EngineConfig& ec = config;
    for (int i = 0; i < config.threads; ++i) {
        std::unique_ptr<Worker> w(new Worker());
        EngineError error;
        w->engine = make_engine(config.engine, ec, &error);
        if (!w->engine) {
            throw std::system_error(error.err, std::generic_category(),
                                    "cannot start engine '" + config.engine + "': " + error.message);
        }
        workers_.push_back(std::move(w));
    }
    try {
        for (auto& w : workers_) {
            Worker* raw = w.get();
            threads_.emplace_back([this, raw] { worker_loop(raw); });
        }
    } catch (const std::exception& e) {  // std::system_error (EAGAIN: too many threads) or std::bad_alloc
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
            closed_ = true;
        }
        work_cv_.notify_all();
        for (auto& t : threads_) t.join();
        threads_.clear();
        const auto* system = dynamic_cast<const std::system_error*>(&e);
        throw std::system_error(system ? system->code() : std::make_error_code(std::errc::not_enough_memory),
                                std::string("cannot start IO worker threads: ") + e.what());
    }
}

IoHandle::~IoHandle() {
    try {
        close();
    } catch (...) {
        // close() only throws if joining fails; nothing more can be done here.
    }
}

int64_t IoHandle::submit(bool write, char* buffer, size_t nbytes, const std::string& path, int fd, int64_t offset,
                         unsigned flags) {
    if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
    if (buffer == nullptr && nbytes > 0) throw std::invalid_argument("ptr must not be 0 when nbytes > 0");
    if (nbytes > static_cast<size_t>(INT64_MAX) - static_cast<size_t>(offset)) {
        throw std::invalid_argument("offset + nbytes overflows");
    }
    if (flags & ~kAllFlags) {
        throw std::invalid_argument("flags must combine TRUNCATE=1, BUFFERED=2, FSYNC=4, got " +
                                    std::to_string(flags));
    }
    if (fd < 0 && path.empty()) throw std::invalid_argument("path must not be empty when fd < 0");

    std::shared_ptr<Op> op = std::make_shared<Op>();
    op->write = write;
    op->buf = buffer;
    op->nbytes = nbytes;
    op->path = path.empty() ? "<fd " + std::to_string(fd) + ">" : path;
    op->user_fd = fd;
    op->offset = offset;
    op->flags = flags;
    op->result.path = op->path;

    int64_t id;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closed_) throw std::runtime_error("the handle is closed");
        id = next_id_++;
        ops_[id] = op;
        queue_.push_back(Task{op, -1});
        ++running_;
        if (op->truncating()) ++truncating_;
    }
    work_cv_.notify_one();
    return id;
}

std::shared_ptr<Op> IoHandle::find(int64_t op_id) {
    auto it = ops_.find(op_id);
    if (it == ops_.end()) {
        throw std::invalid_argument("unknown op id " + std::to_string(op_id) +
                                    " (never submitted, or its result was already collected by wait)");
    }
    return it->second;
}

bool IoHandle::wait(int64_t op_id, double timeout_s, OpResult* result) {
    std::unique_lock<std::mutex> lock(mutex_);
    std::shared_ptr<Op> op = find(op_id);
    auto is_done = [&op] { return op->done; };
    if (timeout_s < 0 || timeout_s > 1e7) {
        done_cv_.wait(lock, is_done);
    } else if (!done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), is_done)) {
        return false;
    }
    find(op_id);  // another thread may have collected it meanwhile
    ops_.erase(op_id);
    std::lock_guard<std::mutex> result_lock(op->result_mutex);
    *result = op->result;
    return true;
}

bool IoHandle::done(int64_t op_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return find(op_id)->done;
}

size_t IoHandle::pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ops_.size();
}

void IoHandle::close() {
    std::vector<std::thread> threads;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        closed_ = true;
        done_cv_.wait(lock, [this] { return running_ == 0; });
        stopping_ = true;
        threads.swap(threads_);
    }
    work_cv_.notify_all();
    for (auto& t : threads) t.join();
}

void IoHandle::worker_loop(Worker* worker) {
    platform::block_signals_in_this_thread();
    for (;;) {
        Task task;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stopping and nothing left
            task = std::move(queue_.front());
            queue_.pop_front();
        }
        Op& op = *task.op;
        if (task.shard < 0) {
            try {
                prepare(task.op);
            } catch (const std::exception& e) {
                // Only allocation can throw here, before any shard was queued.
                op.fail(ENOMEM, "submit", op.offset, std::string("cannot plan the operation: ") + e.what());
                complete(op);
            }
            continue;
        }
        try {
            run_shard(worker, op, task.shard);
        } catch (const std::exception& e) {
            op.fail(ENOMEM, op.write ? "write" : "read", op.shards[static_cast<size_t>(task.shard)].first,
                    std::string("internal error: ") + e.what());
        }
        finish_shard(op);
    }
}

// Opens the file (unless the caller gave a descriptor), learns the alignment and
// queues one task per shard. Runs on a worker so submit() never blocks on IO.
void IoHandle::prepare(const std::shared_ptr<Op>& op_ptr) {
    Op& op = *op_ptr;
    const bool want_direct = (op.flags & kFlagBuffered) == 0;
    if (op.user_fd >= 0) {
        int is_direct = platform::fd_is_direct(op.user_fd);
        if (is_direct < 0) {
            op.fail(-is_direct, "open", op.offset,
                    "descriptor " + std::to_string(op.user_fd) + " for '" + op.path +
                        "' is not usable: " + platform::errno_text(-is_direct));
            complete(op);
            return;
        }
        if (is_direct == 1) {
            // An O_DIRECT descriptor cannot do unaligned IO: add a buffered one.
            int bfd = platform::reopen_buffered(op.user_fd, op.write);
            if (bfd < 0) {
                op.fail(-bfd, "open", op.offset,
                        "cannot open a buffered descriptor next to O_DIRECT descriptor " +
                            std::to_string(op.user_fd) + " for '" + op.path + "': " + platform::errno_text(-bfd));
                complete(op);
                return;
            }
            op.buffered_fd = bfd;
            op.own_buffered_fd = true;
            op.io_fd = want_direct ? op.user_fd : bfd;
            op.direct = want_direct;
        } else {
            op.io_fd = op.buffered_fd = op.user_fd;
        }
    } else {
        if (want_direct) {
            int fd = platform::open_file(op.path, op.write, true);
            if (fd >= 0) {
                op.io_fd = fd;
                op.own_io_fd = true;
                op.direct = true;
            } else if (fd == -ESPIPE) {
                fail_stream(op);
                complete(op);
                return;
            } else if (fd != -EINVAL) {  // EINVAL: the file system refuses O_DIRECT; go buffered
                op.fail(-fd, "open", op.offset,
                        "cannot open '" + op.path + "' for " + (op.write ? "writing" : "reading") + ": " +
                            platform::errno_text(-fd));
                complete(op);
                return;
            }
        }
        int bfd = platform::open_file(op.path, op.write, false);
        if (bfd == -ESPIPE) {
            fail_stream(op);
            complete(op);
            return;
        }
        if (bfd < 0) {
            op.fail(-bfd, "open", op.offset,
                    "cannot open '" + op.path + "' for " + (op.write ? "writing" : "reading") + ": " +
                        platform::errno_text(-bfd));
            complete(op);
            return;
        }
        op.buffered_fd = bfd;
        op.own_buffered_fd = true;
        if (!op.direct) op.io_fd = bfd;
    }
    // Non-regular files never reach an engine that could block on them forever.
    const int type = platform::file_type(op.buffered_fd);
    if (type == platform::kStream) {
        fail_stream(op);
        complete(op);
        return;
    }
    op.regular = type == platform::kRegularFile;
    if (type == platform::kCharDevice) {
        op.sync_only = true;
        if (op.direct && op.own_io_fd) platform::close_file(op.io_fd);
        op.own_io_fd = false;
        op.io_fd = op.buffered_fd;
        op.direct = false;
    }
    if (op.direct) {
        platform::DioAlignment a = platform::query_dio_alignment(op.io_fd);
        if (a.known && !a.supported) {
            if (op.own_io_fd) platform::close_file(op.io_fd);
            op.own_io_fd = false;
            op.io_fd = op.buffered_fd;
            op.direct = false;
        } else {
            op.mem_align = a.memory;
            op.off_align = std::max(a.offset, kPageSize);
        }
    }
    op.result.direct = op.direct;

    // Extending direct writes are serialized by some file systems (ext4 waits for
    // each one): allocate the range first so the blocks land inside the file.
    // fallocate never shortens the file, so writes to other parts of it running
    // meanwhile keep their bytes (a size check followed by ftruncate could cut
    // them). Where it is unsupported the writes extend the file themselves.
    if (op.write && op.direct && op.nbytes > 0 && platform::is_regular_file(op.buffered_fd) == 1) {
        const int64_t end = op.end();
        const int64_t size = platform::file_size(op.buffered_fd);
        int rc = size < 0 ? static_cast<int>(size)
                          : (size < end ? platform::grow_file(op.buffered_fd, op.offset, end - op.offset) : 0);
        if (rc < 0 && rc != -EOPNOTSUPP) {
            op.fail(-rc, "write", op.offset,
                    "cannot allocate bytes " + std::to_string(op.offset) + " to " + std::to_string(end) + " of '" +
                        op.path + "' (fallocate): " + platform::errno_text(-rc));
            complete(op);
            return;
        }
    }

    // Plan shards: interior cuts at multiples of `unit` from the aligned start.
    const int64_t begin = op.offset;
    const int64_t end = op.offset + static_cast<int64_t>(op.nbytes);
    if (op.nbytes > 0) {
        const int64_t align = static_cast<int64_t>(op.off_align);
        const int64_t unit = std::max<int64_t>({align, static_cast<int64_t>(op.mem_align),
                                                static_cast<int64_t>(kShardUnit)});
        const int64_t mid_begin = std::min(end, round_up(begin, align));
        const int64_t units = (end - mid_begin) / unit;
        const int64_t k = std::max<int64_t>(1, std::min<int64_t>(config_.threads, units));
        for (int64_t i = 0; i < k; ++i) {
            int64_t s = i == 0 ? begin : mid_begin + unit * (units * i / k);
            int64_t e = i == k - 1 ? end : mid_begin + unit * (units * (i + 1) / k);
            op.shards.emplace_back(s, e);
        }
    }
    if (op.shards.empty()) {
        complete(op);
        return;
    }
    op.shards_left.store(static_cast<int>(op.shards.size()));
    {
        std::lock_guard<std::mutex> lock(mutex_);
        // Shards go to the front so one op's shards run together, in order.
        for (size_t i = op.shards.size(); i-- > 0;) queue_.push_front(Task{op_ptr, static_cast<int>(i)});
    }
    work_cv_.notify_all();
}

void IoHandle::run_shard(Worker* worker, Op& op, int shard) {
    if (op.failed.load()) return;
    const int64_t b = op.shards[static_cast<size_t>(shard)].first;
    const int64_t e = op.shards[static_cast<size_t>(shard)].second;
    const int64_t align = static_cast<int64_t>(op.off_align);
    const int64_t mid_b = std::min(e, round_up(b, align));
    const int64_t mid_e = std::max(mid_b, round_down(e, align));
    auto mem = [&op](int64_t file_offset) { return op.buf + (file_offset - op.offset); };  // user memory of a byte
    if (op.sync_only) {
        transfer_buffered(op, mem(b), static_cast<size_t>(e - b), b);
        return;
    }

    // Unaligned head, synchronously through the buffered descriptor.
    if (!transfer_buffered(op, mem(b), static_cast<size_t>(mid_b - b), b)) return;

    if (mid_e > mid_b) {
        // Direct blocks are whole multiples of both alignments so every block's
        // memory and file offset stay aligned.
        const int64_t grain = std::max<int64_t>(align, static_cast<int64_t>(op.mem_align));
        const size_t block = op.direct ? static_cast<size_t>(std::max<int64_t>(
                                             grain, round_down(static_cast<int64_t>(config_.block_size), grain)))
                                       : config_.block_size;
        char* user = mem(mid_b);
        const size_t len = static_cast<size_t>(mid_e - mid_b);
        if (!op.direct || reinterpret_cast<uintptr_t>(user) % op.mem_align == 0) {
            // Fast path: the engine works on the caller's memory.
            make_blocks(&worker->blocks, op.io_fd, op.write, user, len, mid_b, block);
            worker->engine->run(worker->blocks.data(), worker->blocks.size());
            if (!settle_blocks(op, worker->blocks.data(), worker->blocks.size())) return;
        } else if (!transfer_bounced(worker, op, user, len, mid_b, block)) {
            return;
        }
    }

    // Unaligned tail.
    transfer_buffered(op, mem(mid_e), static_cast<size_t>(e - mid_e), mid_e);
}

// Misaligned user memory: stage [user, user+len) (file offset `at`) through the
// worker's aligned bounce buffer, split in two slots of `half` bytes used in
// turn. While the engine transfers one slot, a helper thread copies the next
// wave into the other (writes) or the previous wave out of it (reads).
bool IoHandle::transfer_bounced(Worker* worker, Op& op, char* user, size_t len, int64_t at, size_t block) {
    const size_t qd = static_cast<size_t>(config_.queue_depth);
    const size_t half = std::max(block, std::min(block * qd, kMaxBounceBytes / 2 / block * block));
    const size_t slots = len > half ? 2 : 1;
    if (!worker->ensure_bounce(slots * half, std::max<size_t>(op.mem_align, 4096))) {
        op.fail(ENOMEM, op.write ? "write" : "read", at,
                "cannot allocate a " + std::to_string(slots * half) + "-byte bounce buffer");
        return false;
    }
    char* slot[2] = {worker->bounce, worker->bounce + (slots - 1) * half};
    const size_t waves = (len + half - 1) / half;
    auto wave_len = [&](size_t i) { return std::min(half, len - i * half); };
    BackgroundCopy copy;
    if (op.write) std::memcpy(slot[0], user, wave_len(0));
    for (size_t i = 0; i < waves; ++i) {
        if (op.failed.load()) return false;
        char* buf = slot[i % 2];
        const size_t n = wave_len(i);
        if (op.write && i + 1 < waves) copy.start(slot[(i + 1) % 2], user + (i + 1) * half, wave_len(i + 1));
        make_blocks(&worker->blocks, op.io_fd, op.write, buf, n, at + static_cast<int64_t>(i * half), block);
        worker->engine->run(worker->blocks.data(), worker->blocks.size());
        copy.join();  // the other slot is free again
        if (copy.faulted()) break;
        if (!settle_blocks(op, worker->blocks.data(), worker->blocks.size())) return false;
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

void IoHandle::finish_shard(Op& op) {
    if (op.shards_left.fetch_sub(1) == 1) complete(op);
}

// The size a truncating write leaves: its own end, or the furthest end of the
// other writes to the same file (named by the same path or descriptor) through
// this handle that ran alongside it (submitted before it completed and not
// complete before it was submitted), so their bytes are never cut. Writes that
// completed before it was submitted are replaced: it is a whole-file write.
int64_t IoHandle::truncate_size(const Op& op) {
    int64_t keep = std::max(op.end(), op.keep_end);
    for (const auto& kv : ops_) {
        const Op& other = *kv.second;
        if (&other != &op && other.write && !other.done && other.path == op.path) keep = std::max(keep, other.end());
    }
    return keep;
}

// Runs once per op after its last shard: truncate/fsync, close, publish.
void IoHandle::complete(Op& op) {
    const int sync_fd = op.buffered_fd >= 0 ? op.buffered_fd : op.io_fd;
    if (op.write && !op.failed.load() && sync_fd >= 0) {
        if ((op.flags & kFlagTruncate) && op.regular) {  // a device has no length to set
            // Under the handle's lock, so no write through it can start or finish between measuring and cutting.
            std::lock_guard<std::mutex> lock(mutex_);
            const int64_t size = truncate_size(op);
            int rc = platform::truncate_fd(sync_fd, size);
            if (rc < 0) {
                op.fail(-rc, "truncate", size,
                        "cannot truncate '" + op.path + "' to " + std::to_string(size) +
                            " bytes: " + platform::errno_text(-rc));
            }
        }
        if ((op.flags & kFlagFsync) && !op.failed.load()) {
            int rc = platform::sync_data(sync_fd);
            if (rc < 0) {
                op.fail(-rc, "fsync", op.offset, "fdatasync of '" + op.path + "' failed: " + platform::errno_text(-rc));
            }
        }
    }
    int fds[2] = {op.own_io_fd ? op.io_fd : -1, op.own_buffered_fd ? op.buffered_fd : -1};
    for (int fd : fds) {
        if (fd < 0) continue;
        int rc = platform::close_file(fd);
        if (rc < 0) op.fail(-rc, "close", op.offset, "close of '" + op.path + "' failed: " + platform::errno_text(-rc));
    }
    op.own_io_fd = op.own_buffered_fd = false;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        op.done = true;
        --running_;
        if (op.truncating()) --truncating_;
        if (op.write && truncating_ > 0) {  // truncating writes still running must keep this write's bytes
            for (auto& kv : ops_) {
                Op& other = *kv.second;
                if (other.truncating() && !other.done && other.path == op.path) {
                    other.keep_end = std::max(other.keep_end, op.end());
                }
            }
        }
    }
    done_cv_.notify_all();
}

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
            config.threads = 1;
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
