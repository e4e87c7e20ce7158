// Linux native AIO engine (libaio). Compiled only with DEEPOFFLOAD_HAVE_LIBAIO.
#ifdef DEEPOFFLOAD_HAVE_LIBAIO

#include "engine.h"
#include "platform.h"

#include <libaio.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace deepoffload {

namespace {

constexpr int kMaxBusyRetries = 5000;  // 1 ms apart: give up on EAGAIN after ~5 s with nothing in flight

class LibaioEngine final : public Engine {
public:
    explicit LibaioEngine(const EngineConfig& config)
        : config_(config),
          iocbs_(static_cast<size_t>(config.queue_depth)),
          iocb_ptrs_(static_cast<size_t>(config.queue_depth)),
          events_(static_cast<size_t>(config.queue_depth)) {}

    ~LibaioEngine() override {
        if (ctx_ != nullptr) io_destroy(ctx_);
    }

    int init() {
        ctx_ = nullptr;
        int rc = io_setup(config_.queue_depth, &ctx_);
        if (rc < 0) ctx_ = nullptr;
        return rc;
    }

    const char* name() const override { return "libaio"; }

    void run(Request* requests, size_t n) override {
        if (ctx_ == nullptr) {  // a previous failure destroyed the context
            int rc = init();
            if (rc < 0) {
                for (size_t i = 0; i < n; ++i) {
                    requests[i].result = rc;
                    requests[i].submit_failed = true;
                }
                return;
            }
        }
        size_t next = 0;      // first request not yet submitted
        size_t in_flight = 0;
        int busy_retries = 0;
        free_slots_.clear();
        for (size_t i = 0; i < iocbs_.size(); ++i) free_slots_.push_back(iocbs_.size() - 1 - i);

        while (next < n || in_flight > 0) {
            const size_t qd = static_cast<size_t>(config_.queue_depth);
            const bool may_submit = config_.overlap_events || in_flight == 0;
            while (may_submit && next < n && in_flight < qd) {
                size_t room = qd - in_flight;
                size_t count = config_.single_submit ? 1 : std::min(room, n - next);
                for (size_t i = 0; i < count; ++i) {
                    Request& b = requests[next + i];
                    b.submit_failed = false;
                    b.result = 0;
                    iocb* cb = &iocbs_[free_slots_[free_slots_.size() - 1 - i]];
                    if (b.write) {
                        io_prep_pwrite(cb, b.fd, b.buf, b.len, b.offset);
                    } else {
                        io_prep_pread(cb, b.fd, b.buf, b.len, b.offset);
                    }
                    cb->data = &b;
                    iocb_ptrs_[i] = cb;
                }
                int rc = io_submit(ctx_, static_cast<long>(count), iocb_ptrs_.data());
                if (rc == -EINTR) continue;
                if (rc == -EAGAIN) {
                    if (in_flight > 0) break;  // reap some, then submit again
                    if (++busy_retries <= kMaxBusyRetries) {
                        std::this_thread::sleep_for(std::chrono::milliseconds(1));
                        continue;
                    }
                }
                if (rc < 0) {  // the kernel rejected the first iocb: fail that request, go on
                    requests[next].result = rc;
                    requests[next].submit_failed = true;
                    ++next;
                    continue;
                }
                busy_retries = 0;
                // rc iocbs were accepted (possibly fewer than count: the rest is resubmitted).
                free_slots_.resize(free_slots_.size() - static_cast<size_t>(rc));
                next += static_cast<size_t>(rc);
                in_flight += static_cast<size_t>(rc);
            }
            if (in_flight == 0) continue;

            long min_nr = config_.overlap_events ? 1 : static_cast<long>(in_flight);
            int got = reap(min_nr, static_cast<long>(in_flight));
            if (got == -EINTR) continue;
            if (got < 0) {
                fail_in_flight(requests, next, got);
                in_flight = 0;
                continue;
            }
            for (int i = 0; i < got; ++i) {
                const io_event& ev = events_[static_cast<size_t>(i)];
                Request* b = static_cast<Request*>(ev.data);
                long res = static_cast<long>(ev.res);
                long res2 = static_cast<long>(ev.res2);
                if (res < 0) {
                    b->result = res;
                } else if (res2 != 0) {
                    b->result = res2 < 0 ? res2 : -EIO;
                } else {
                    b->result = res;
                }
                free_slots_.push_back(static_cast<size_t>(ev.obj - iocbs_.data()));
            }
            in_flight -= static_cast<size_t>(got);
        }
    }

private:
    int reap(long min_nr, long max_nr) {
#ifdef DEEPOFFLOAD_HAVE_PGETEVENTS
        if (use_pgetevents_) {
            int rc = io_pgetevents(ctx_, min_nr, max_nr, events_.data(), nullptr, nullptr);
            if (rc != -ENOSYS) return rc;
            use_pgetevents_ = false;  // kernel older than 4.18: fall back for good
        }
#endif
        return io_getevents(ctx_, min_nr, max_nr, events_.data(), nullptr);
    }

    // Reaping failed for a reason other than EINTR (should not happen). Destroying
    // the context waits for the kernel to finish with our buffers; then start afresh.
    void fail_in_flight(Request* requests, size_t submitted, int err) {
        io_destroy(ctx_);
        ctx_ = nullptr;
        for (size_t i = 0; i < submitted; ++i) {
            if (requests[i].result == 0 && requests[i].len > 0) requests[i].result = err;
        }
        free_slots_.clear();
        for (size_t i = 0; i < iocbs_.size(); ++i) free_slots_.push_back(i);
        init();  // if this fails, the next run() retries and reports it
    }

    EngineConfig config_;
    io_context_t ctx_ = nullptr;
    std::vector<iocb> iocbs_;
    std::vector<iocb*> iocb_ptrs_;
    std::vector<io_event> events_;
    std::vector<size_t> free_slots_;
#ifdef DEEPOFFLOAD_HAVE_PGETEVENTS
    bool use_pgetevents_ = true;
#endif
};

}  // namespace

std::unique_ptr<Engine> make_libaio_engine(const EngineConfig& config, EngineError* error) {
    std::unique_ptr<LibaioEngine> engine(new LibaioEngine(config));
    int rc = engine->init();
    if (rc < 0) {
        error->err = -rc;
        error->message = "libaio: io_setup(" + std::to_string(config.queue_depth) + ") failed: " +
                         platform::errno_text(-rc) +
                         (rc == -EAGAIN ? " (raise /proc/sys/fs/aio-max-nr or lower queue_depth/intra_op_parallelism)" : "");
        return nullptr;
    }
    return engine;
}

}  // namespace deepoffload

#endif  // DEEPOFFLOAD_HAVE_LIBAIO
