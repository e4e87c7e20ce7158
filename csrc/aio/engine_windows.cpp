// Windows engine: overlapped ReadFile/WriteFile at explicit offsets, up to
// queue_depth in flight. Completions arrive on the process-wide I/O completion
// port (platform_windows.cpp binds every file it opens to it); one dispatcher
// thread hands each completion to the engine that started it, so one file may
// be used by several engines (worker threads) at once, which binding a handle
// to a per-engine port would forbid. Descriptors that are not bound to the
// port (a caller's synchronous handle) are transferred synchronously.
// single_submit has no effect: every ReadFile/WriteFile is its own submission.
#if defined(_WIN32)

#include "engine.h"
#include "platform.h"
#include "platform_windows.h"

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace deepoffload {

namespace {

class WindowsEngine;

// One transfer in flight. The completion packet carries &ov.
struct Slot {
    OVERLAPPED ov;
    WindowsEngine* owner = nullptr;
    Block* block = nullptr;
    DWORD bytes = 0;  // set by the dispatcher
    DWORD code = 0;   // Win32 error of the transfer, 0 on success; set by the dispatcher
};

class WindowsEngine final : public Engine {
public:
    explicit WindowsEngine(const EngineConfig& config)
        : slots_(static_cast<size_t>(config.queue_depth)), overlap_events_(config.overlap_events) {
        for (Slot& s : slots_) {
            s.owner = this;
            free_.push_back(&s);
        }
    }

    const char* name() const override { return "windows"; }

    void run(Block* blocks, size_t n) override {
        size_t next = 0;
        size_t in_flight = 0;
        std::vector<Slot*> ready;
        while (next < n || in_flight > 0) {
            // Without overlap_events a new wave starts only when the previous one is reaped.
            if (overlap_events_ || in_flight == 0) {
                while (next < n && !free_.empty()) {
                    if (start(blocks[next++])) ++in_flight;
                }
            }
            if (in_flight == 0) continue;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [this] { return !completed_.empty(); });
                ready.swap(completed_);
            }
            for (Slot* s : ready) {
                settle(s);
                free_.push_back(s);
                --in_flight;
            }
            ready.clear();
        }
    }

    // Called by the dispatcher thread for each completion packet of this engine.
    void deliver(Slot* s) {
        std::lock_guard<std::mutex> lock(mutex_);
        completed_.push_back(s);
        cv_.notify_one();
    }

private:
    // Starts one transfer. Returns true when a completion packet will follow;
    // otherwise the block's result is already set.
    bool start(Block& b) {
        b.submit_failed = false;
        if (!platform::windows::bound_to_port(b.fd)) {
            b.result = b.write ? platform::pwrite_full(b.fd, b.buf, b.len, b.offset)
                               : platform::pread_full(b.fd, b.buf, b.len, b.offset);
            return false;
        }
        HANDLE h = platform::windows::os_handle(b.fd);
        if (h == INVALID_HANDLE_VALUE) {
            b.result = -EBADF;
            return false;
        }
        Slot* s = free_.back();
        free_.pop_back();
        std::memset(&s->ov, 0, sizeof(s->ov));
        const uint64_t at = static_cast<uint64_t>(b.offset);
        s->ov.Offset = static_cast<DWORD>(at & 0xffffffffu);
        s->ov.OffsetHigh = static_cast<DWORD>(at >> 32);
        s->block = &b;
        // Blocks are at most 1 GiB (IoHandle's limit), so the length fits a DWORD.
        const DWORD len = static_cast<DWORD>(b.len);
        BOOL ok = b.write ? WriteFile(h, b.buf, len, nullptr, &s->ov) : ReadFile(h, b.buf, len, nullptr, &s->ov);
        if (!ok) {
            DWORD code = GetLastError();
            if (code != ERROR_IO_PENDING) {  // failed at once: no packet is queued
                free_.push_back(s);
                b.result = code == ERROR_HANDLE_EOF ? 0 : platform::windows::from_win32(code);
                return false;
            }
        }
        return true;  // pending, or done at once: either way a packet is queued
    }

    static void settle(Slot* s) {
        Block& b = *s->block;
        if (s->code == 0 || s->code == ERROR_HANDLE_EOF) {
            b.result = static_cast<int64_t>(s->bytes);  // short at end of file; IoHandle finishes or reports it
        } else {
            b.result = platform::windows::from_win32(s->code);  // on this thread, so errno_text names the code
        }
    }

    std::vector<Slot> slots_;  // fixed size: OVERLAPPED addresses must not move
    std::vector<Slot*> free_;  // used by the run() thread only
    bool overlap_events_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<Slot*> completed_;  // guarded by mutex_
};

// Hands every completion packet of the process-wide port to the engine that started the transfer.
void dispatch_completions(HANDLE port) {
    for (;;) {
        DWORD bytes = 0;
        ULONG_PTR key = 0;
        OVERLAPPED* ov = nullptr;
        BOOL ok = GetQueuedCompletionStatus(port, &bytes, &key, &ov, INFINITE);
        if (ov == nullptr) {
            if (!ok) return;  // the port itself failed; nothing more will arrive
            continue;
        }
        Slot* s = CONTAINING_RECORD(ov, Slot, ov);
        s->bytes = bytes;
        s->code = ok ? 0 : GetLastError();
        s->owner->deliver(s);
    }
}

std::once_flag g_dispatcher_started;

}  // namespace

std::unique_ptr<Engine> make_windows_engine(const EngineConfig& config, EngineError* error) {
    HANDLE port = platform::windows::completion_port();
    if (port == nullptr) {
        error->err = -platform::windows::from_win32(GetLastError());
        error->message = "cannot create an I/O completion port: " + platform::errno_text(error->err);
        return nullptr;
    }
    try {
        // The dispatcher lives as long as the process, like the port.
        std::call_once(g_dispatcher_started, [port] { std::thread(dispatch_completions, port).detach(); });
        return std::unique_ptr<Engine>(new WindowsEngine(config));
    } catch (const std::exception& e) {
        error->err = ENOMEM;
        error->message = std::string("cannot start the completion dispatcher: ") + e.what();
        return nullptr;
    }
}

}  // namespace deepoffload

#endif  // _WIN32
