// The handle: worker threads, the queue of tasks (one per op to open and plan it, then one per shard), waiting
// and completion (truncate, fsync, close, publish). What happens to the bytes is in transfer.cpp, how an op is cut
// in plan.cpp.
#include "io_handle.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "expect.h"
#include "op.h"
#include "platform.h"

namespace deepoffload {

namespace {

constexpr size_t kMaxBlockSize = size_t(1) << 30;
constexpr int kMaxQueueDepth = 32768;
constexpr int kMaxThreads = 256;

std::string list_names(const std::vector<std::string>& names) {
    std::string s = "[";
    for (size_t i = 0; i < names.size(); ++i) {
        if (i) s += ", ";
        s += "'" + names[i] + "'";
    }
    return s + "]";
}

}  // namespace

IoHandle::IoHandle(const HandleConfig& config) : config_(config) {
    const std::vector<std::string> names = compiled_engines();
    DEEPOFFLOAD_EXPECT(std::find(names.begin(), names.end(), config.engine) != names.end(),
                       std::invalid_argument("engine must be one of " + list_names(names) + ", got '" +
                                             config.engine + "'"));
    DEEPOFFLOAD_EXPECT(config.block_size >= 4096 && config.block_size <= kMaxBlockSize,
                       std::invalid_argument("block_size must be between 4096 and " + std::to_string(kMaxBlockSize) +
                                             " bytes, got " + std::to_string(config.block_size)));
    DEEPOFFLOAD_EXPECT(config.queue_depth >= 1 && config.queue_depth <= kMaxQueueDepth,
                       std::invalid_argument("queue_depth must be between 1 and " + std::to_string(kMaxQueueDepth) +
                                             ", got " + std::to_string(config.queue_depth)));
    DEEPOFFLOAD_EXPECT(config.intra_op_parallelism >= 1 && config.intra_op_parallelism <= kMaxThreads,
                       std::invalid_argument("intra_op_parallelism must be between 1 and " +
                                             std::to_string(kMaxThreads) + ", got " +
                                             std::to_string(config.intra_op_parallelism)));
    for (int i = 0; i < config.intra_op_parallelism; ++i) {
        std::unique_ptr<Worker> w(new Worker());
        EngineError error;
        w->engine = make_engine(config.engine, config, &error);
        DEEPOFFLOAD_EXPECT(w->engine != nullptr,
                           std::system_error(error.err, std::generic_category(),
                                             "cannot start engine '" + config.engine + "': " + error.message));
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
    DEEPOFFLOAD_EXPECT(offset >= 0, std::invalid_argument("offset must be >= 0, got " + std::to_string(offset)));
    DEEPOFFLOAD_EXPECT(buffer != nullptr || nbytes == 0, std::invalid_argument("ptr must not be 0 when nbytes > 0"));
    DEEPOFFLOAD_EXPECT(nbytes <= static_cast<size_t>(INT64_MAX) - static_cast<size_t>(offset),
                       std::invalid_argument("offset + nbytes overflows"));
    DEEPOFFLOAD_EXPECT((flags & ~kAllFlags) == 0,
                       std::invalid_argument("flags must combine TRUNCATE=1, BUFFERED=2, FSYNC=4, got " +
                                             std::to_string(flags)));
    DEEPOFFLOAD_EXPECT(fd >= 0 || !path.empty(), std::invalid_argument("path must not be empty when fd < 0"));

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
    std::vector<std::unique_ptr<Worker>> workers;  // taken by the one close() that stops the threads
    {
        std::unique_lock<std::mutex> lock(mutex_);
        closed_ = true;
        done_cv_.wait(lock, [this] { return running_ == 0; });
        stopping_ = true;
        threads.swap(threads_);
        workers.swap(workers_);
    }
    work_cv_.notify_all();
    for (auto& t : threads) t.join();
    // Each engine's descriptors (an io_uring ring, a libaio context) go now, with their threads, not when the
    // handle object is collected.
    workers.clear();
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
            } catch (const OpFailure& f) {  // before any shard was queued
                op.fail(f.err, f.operation, f.offset, f.detail);
                complete(op);
            } catch (const std::exception& e) {
                // Only allocation can throw here, before any shard was queued.
                op.fail(ENOMEM, "submit", op.offset, std::string("cannot plan the operation: ") + e.what());
                complete(op);
            }
            continue;
        }
        try {
            run_shard(*worker, op, op.shards[static_cast<size_t>(task.shard)], config_);
        } catch (const std::exception& e) {
            op.fail(ENOMEM, op.write ? "write" : "read", op.shards[static_cast<size_t>(task.shard)].begin,
                    std::string("internal error: ") + e.what());
        }
        finish_shard(op);
    }
}

// Opens the files and queues one task per shard. Runs on a worker so submit() never blocks on IO. Throws OpFailure.
void IoHandle::prepare(const std::shared_ptr<Op>& op_ptr) {
    Op& op = *op_ptr;
    open_files(op);
    op.shards = plan_shards(op.offset, op.nbytes, op.off_align, op.mem_align, config_.intra_op_parallelism);
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

}  // namespace deepoffload
