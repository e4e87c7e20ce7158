// Internal to the core: one queued operation (Op) and one worker thread's state (Worker), shared by the handle
// (io_handle.cpp: threads, queue, completion) and the transfers (transfer.cpp: files and bytes).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"
#include "io_handle.h"
#include "plan.h"

namespace deepoffload {

// One queued read or write.
struct Op {
    bool write = false;
    char* buf = nullptr;
    size_t nbytes = 0;
    std::string path;
    int user_fd = -1;
    int64_t offset = 0;
    unsigned flags = 0;

    // Set by open_files.
    int io_fd = -1;        // descriptor for the aligned middle (O_DIRECT when direct)
    int buffered_fd = -1;  // descriptor for unaligned pieces and retries
    bool own_io_fd = false;
    bool own_buffered_fd = false;
    bool direct = false;
    bool regular = true;     // a regular file (else a device): only regular files are truncated
    bool sync_only = false;  // a character device: plain pread/pwrite on this thread, never an engine
    size_t mem_align = 1;
    size_t off_align = 1;
    std::vector<Span> shards;  // set by IoHandle::prepare
    std::atomic<int> shards_left{0};

    std::atomic<bool> failed{false};
    std::mutex result_mutex;
    OpResult result;
    bool done = false;     // guarded by IoHandle::mutex_
    int64_t keep_end = 0;  // kFlagTruncate: furthest end of writes to the same file that ran alongside this one
                           // (guarded by IoHandle::mutex_)

    int64_t end() const { return offset + static_cast<int64_t>(nbytes); }
    bool truncating() const { return write && (flags & kFlagTruncate) != 0; }

    // Records the first failure; later ones are dropped.
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
    std::vector<Request> requests;

    Worker() = default;
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;
    ~Worker();

    // Makes the bounce buffer at least `size` bytes aligned to `align`; grows only.
    bool ensure_bounce(size_t size, size_t align);
};

// Opens the op's descriptors (unless the caller gave one), refuses FIFOs, pipes and sockets, learns the direct-IO
// alignment and, for direct writes, allocates the range. Throws OpFailure (expect.h); the descriptors opened so
// far are then owned by the op, and IoHandle::complete closes them.
void open_files(Op& op);

// Runs one shard of the op on this worker: unaligned head and tail buffered, the aligned middle through the
// engine (bounced when the memory is misaligned). Failures are recorded in the op.
void run_shard(Worker& worker, Op& op, const Span& shard, const EngineConfig& config);

}  // namespace deepoffload
