// Windows engine: overlapped ReadFile/WriteFile at explicit offsets, up to
// queue_depth in flight. Completions arrive on the process-wide I/O completion
// port (platform_windows.cpp binds every file it opens to it); one dispatcher
// thread hands each completion to the engine that started it, so one file may
// be used by several engines (worker threads) at once, which binding a handle
// to a per-engine port would forbid. Descriptors that are not bound to the
// port (a caller's synchronous handle) are transferred synchronously.
// Slots are heap objects so a slot set aside under Wine (see running_on_wine)
// can outlive its engine.
// single_submit has no effect: every ReadFile/WriteFile is its own submission.
#if defined(_WIN32)

#include "engine.h"
#include "platform.h"
#include "platform_windows.h"

#include <algorithm>
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

// Guards every Slot::state and every engine's completed_ and stale_ lists.
std::mutex g_route_mutex;

enum class SlotState { kIdle, kInFlight, kDone, kStale };

// One transfer. The completion packet carries &ov.
struct Slot {
    explicit Slot(WindowsEngine* o) : owner(o) {}
    OVERLAPPED ov;
    WindowsEngine* owner;     // nullptr once a stale slot's engine is gone
    Request* request = nullptr;
    DWORD bytes = 0;          // set by the dispatcher
    DWORD code = 0;           // Win32 error of the transfer, 0 on success; set by the dispatcher
    SlotState state = SlotState::kIdle;
};

// Windows queues no completion packet for a ReadFile/WriteFile that fails at
// once (an error other than ERROR_IO_PENDING). Wine 8 sometimes does (a write
// to a full disk), sometimes not (/dev/full): under Wine such a slot is set
// aside until its packet comes, and a new one takes its place.
bool running_on_wine() {
    HMODULE ntdll = GetModuleHandleW(L"ntdll.dll");
    return ntdll != nullptr && GetProcAddress(ntdll, "wine_get_version") != nullptr;
}

class WindowsEngine final : public Engine {
public:
    explicit WindowsEngine(const EngineConfig& config) : overlap_events_(config.overlap_events) {
        for (int i = 0; i < config.queue_depth; ++i) free_.push_back(new Slot(this));
    }

    ~WindowsEngine() override {
        std::lock_guard<std::mutex> lock(g_route_mutex);
        for (Slot* s : stale_) s->owner = nullptr;  // the dispatcher frees it if its packet ever comes
        for (Slot* s : free_) delete s;
    }

    const char* name() const override { return "windows"; }

    void run(Request* requests, size_t n) override {
        size_t next = 0;
        size_t in_flight = 0;
        std::vector<Slot*> ready;
        while (next < n || in_flight > 0) {
            // Without overlap_events a new wave starts only when the previous one is reaped.
            if (overlap_events_ || in_flight == 0) {
                while (next < n && !free_.empty()) {
                    if (start(requests[next++])) ++in_flight;
                }
            }
            if (in_flight == 0) continue;
            {
                std::unique_lock<std::mutex> lock(g_route_mutex);
                cv_.wait(lock, [this] { return !completed_.empty(); });
                ready.swap(completed_);
                for (Slot* s : ready) s->state = SlotState::kIdle;
            }
            for (Slot* s : ready) {
                settle(s);
                free_.push_back(s);
                --in_flight;
            }
            ready.clear();
        }
    }

    // The dispatcher's side; called with g_route_mutex held.
    static void deliver_locked(Slot* s, DWORD bytes, DWORD code) {
        if (s->state == SlotState::kStale) {  // the packet of a transfer that already failed at once
            if (s->owner != nullptr) {
                std::vector<Slot*>& stale = s->owner->stale_;
                stale.erase(std::find(stale.begin(), stale.end(), s));
            }
            delete s;
            return;
        }
        s->bytes = bytes;
        s->code = code;
        s->state = SlotState::kDone;
        s->owner->completed_.push_back(s);
        s->owner->cv_.notify_one();
    }

private:
    // Starts one transfer. Returns true when a completion packet will follow;
    // otherwise the request's result is already set.
    bool start(Request& b) {
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
        s->request = &b;
        {
            std::lock_guard<std::mutex> lock(g_route_mutex);
            s->state = SlotState::kInFlight;
        }
        // Requests are at most 1 GiB (IoHandle's limit), so the length fits a DWORD.
        const DWORD len = static_cast<DWORD>(b.len);
        BOOL ok = b.write ? WriteFile(h, b.buf, len, nullptr, &s->ov) : ReadFile(h, b.buf, len, nullptr, &s->ov);
        if (ok) return true;  // done at once: a packet is queued all the same
        const DWORD code = GetLastError();
        if (code == ERROR_IO_PENDING) return true;
        b.result = code == ERROR_HANDLE_EOF ? 0 : platform::windows::from_win32(code);
        static const bool wine = running_on_wine();
        std::lock_guard<std::mutex> lock(g_route_mutex);
        if (!wine) {
            s->state = SlotState::kIdle;
            free_.push_back(s);
        } else if (s->state == SlotState::kDone) {  // Wine: its packet already came
            completed_.erase(std::find(completed_.begin(), completed_.end(), s));
            s->state = SlotState::kIdle;
            free_.push_back(s);
        } else {  // Wine: a packet may still come
            s->state = SlotState::kStale;
            stale_.push_back(s);
            free_.push_back(new Slot(this));
        }
        return false;
    }

    static void settle(Slot* s) {
        Request& b = *s->request;
        if (s->code == 0 || s->code == ERROR_HANDLE_EOF) {
            b.result = static_cast<int64_t>(s->bytes);  // short at end of file; IoHandle finishes or reports it
        } else {
            b.result = platform::windows::from_win32(s->code);  // on this thread, so errno_text names the code
        }
    }

    bool overlap_events_;
    std::vector<Slot*> free_;  // owned; used by the run() thread only
    std::condition_variable cv_;
    std::vector<Slot*> completed_;  // guarded by g_route_mutex
    std::vector<Slot*> stale_;      // owned; guarded by g_route_mutex
};

// Hands every completion packet of the process-wide port to the engine that started the transfer.
void dispatch_completions(HANDLE port) {
    for (;;) {
        DWORD bytes = 0;
        ULONG_PTR key = 0;
        OVERLAPPED* ov = nullptr;
        BOOL ok = GetQueuedCompletionStatus(port, &bytes, &key, &ov, INFINITE);
        const DWORD code = ok ? 0 : GetLastError();
        if (ov == nullptr) {
            if (!ok) return;  // the port itself failed; nothing more will arrive
            continue;
        }
        std::lock_guard<std::mutex> lock(g_route_mutex);
        WindowsEngine::deliver_locked(CONTAINING_RECORD(ov, Slot, ov), bytes, code);
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
