// The IO handle: worker threads that split each read/write operation into
// shards and requests, handle alignment, bounce buffers, short transfers and
// errors once for every engine (io_handle.cpp, transfer.cpp, plan.cpp). No Python here.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"

namespace deepoffload {

enum OpFlags : unsigned {
    kFlagTruncate = 1u,  // after a successful write, the file ends at offset + nbytes, or at the furthest end of
                         // writes to the same file through this handle that ran alongside it (never cuts those)
    kFlagBuffered = 2u,  // do not use O_DIRECT
    kFlagFsync = 4u,     // fdatasync after a successful write
};
constexpr unsigned kAllFlags = kFlagTruncate | kFlagBuffered | kFlagFsync;

// Outcome of one operation. err == 0 means success.
struct OpResult {
    int err = 0;
    std::string operation;  // "open", "read", "write", "submit", "truncate", "fsync", "close"
    std::string path;
    int64_t offset = 0;     // file offset of the failing piece
    std::string detail;
    bool direct = false;    // O_DIRECT was used for the aligned part of the op
};

// The engine settings (and their defaults, from EngineConfig) plus what only the handle uses.
struct HandleConfig : EngineConfig {
    std::string engine = compiled_engines().back();  // the portable engine: "posix" ("windows" on Windows)
    int intra_op_parallelism = 1;  // worker threads, each with its own engine (DeepSpeed's name)
};

struct Op;
struct Worker;

class IoHandle {
public:
    // Throws std::invalid_argument for bad settings, std::system_error (the errno
    // in its code) when an engine or a worker thread cannot be created.
    explicit IoHandle(const HandleConfig& config);
    ~IoHandle();  // waits for in-flight ops, joins threads; never throws
    IoHandle(const IoHandle&) = delete;
    IoHandle& operator=(const IoHandle&) = delete;

    // Queues an operation and returns its id (> 0). `buffer` must stay valid
    // until wait() returns the result. fd >= 0: use that descriptor (not closed);
    // `path` is then only used in messages. Throws std::invalid_argument for bad
    // arguments, std::runtime_error after close().
    int64_t submit(bool write, char* buffer, size_t nbytes, const std::string& path, int fd, int64_t offset,
                   unsigned flags);

    // Waits up to timeout_s seconds (< 0: forever). Returns false on timeout;
    // otherwise fills *result and forgets the op. Throws std::invalid_argument
    // for an unknown id.
    bool wait(int64_t op_id, double timeout_s, OpResult* result);
    bool done(int64_t op_id);  // throws std::invalid_argument for an unknown id
    size_t pending();          // submitted and not yet collected by wait()
    void close();              // waits for in-flight ops and joins threads; idempotent

    const HandleConfig& config() const { return config_; }

private:
    struct Task {
        std::shared_ptr<Op> op;
        int shard;  // -1: open files and plan shards
    };

    void worker_loop(Worker* worker);
    void prepare(const std::shared_ptr<Op>& op);
    void finish_shard(Op& op);
    void complete(Op& op);
    int64_t truncate_size(const Op& op);  // caller holds mutex_
    std::shared_ptr<Op> find(int64_t op_id);

    HandleConfig config_;
    std::mutex mutex_;
    std::condition_variable work_cv_;  // workers wait for tasks
    std::condition_variable done_cv_;  // waiters wait for op completion
    std::deque<Task> queue_;
    std::map<int64_t, std::shared_ptr<Op>> ops_;
    int64_t next_id_ = 1;
    size_t running_ = 0;     // ops submitted and not yet complete
    size_t truncating_ = 0;  // of those, writes with kFlagTruncate
    bool stopping_ = false;
    bool closed_ = false;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::vector<std::thread> threads_;
};

}  // namespace deepoffload
