// io_uring engine (liburing). Compiled only with DEEPOFFLOAD_HAVE_URING.
#ifdef DEEPOFFLOAD_HAVE_URING

#include "engine.h"
#include "platform.h"

#include <liburing.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

namespace deepoffload {

namespace {

constexpr int kMaxBusyRetries = 5000;  // 1 ms apart

class UringEngine final : public Engine {
public:
    explicit UringEngine(const EngineConfig& config) : config_(config) {}

    ~UringEngine() override {
        if (ready_) io_uring_queue_exit(&ring_);
    }

    // Sets up the ring and proves it works (seccomp/containers may forbid io_uring).
    // Returns 0 or -errno; *what names the failing step.
    int init(std::string* what) {
        std::memset(&ring_, 0, sizeof(ring_));
        int rc = io_uring_queue_init(static_cast<unsigned>(config_.queue_depth), &ring_, 0);
        if (rc < 0) {
            *what = "io_uring_queue_init(" + std::to_string(config_.queue_depth) + ")";
            return rc;
        }
        ready_ = true;
        io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
        if (probe != nullptr) {
            bool ok = io_uring_opcode_supported(probe, IORING_OP_READ) &&
                      io_uring_opcode_supported(probe, IORING_OP_WRITE);
            io_uring_free_probe(probe);
            if (!ok) {
                *what = "kernel lacks IORING_OP_READ/WRITE (needs Linux >= 5.6)";
                return -ENOSYS;
            }
        }
        // Round trip of a no-op request.
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) {
            *what = "io_uring_get_sqe";
            return -EBUSY;
        }
        io_uring_prep_nop(sqe);
        do {
            rc = io_uring_submit(&ring_);
        } while (rc == -EINTR);
        if (rc < 0) {
            *what = "io_uring_submit(nop)";
            return rc;
        }
        io_uring_cqe* cqe = nullptr;
        do {
            rc = io_uring_wait_cqe(&ring_, &cqe);
        } while (rc == -EINTR);
        if (rc < 0) {
            *what = "io_uring_wait_cqe(nop)";
            return rc;
        }
        rc = cqe->res;
        io_uring_cqe_seen(&ring_, cqe);
        if (rc < 0) *what = "nop request";
        return rc < 0 ? rc : 0;
    }

    const char* name() const override { return "io_uring"; }

    void run(Request* requests, size_t n) override {
        if (!ready_) {
            std::string what;
            int rc = init(&what);
            if (rc < 0) {
                fail_all(requests, 0, n, rc);
                return;
            }
        }
        const size_t qd = static_cast<size_t>(config_.queue_depth);
        size_t next = 0;       // first request not yet placed in the ring
        size_t prepared = 0;   // placed in the ring, not yet accepted by the kernel
        size_t in_flight = 0;  // accepted by the kernel, not yet completed
        size_t first_prepared = 0;
        int busy_retries = 0;

        while (next < n || prepared > 0 || in_flight > 0) {
            if (config_.overlap_events || in_flight == 0) {
                while (next < n && in_flight + prepared < qd) {
                    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
                    if (sqe == nullptr) break;
                    Request& b = requests[next];
                    b.result = 0;
                    b.submit_failed = false;
                    if (b.write) {
                        io_uring_prep_write(sqe, b.fd, b.buf, static_cast<unsigned>(b.len),
                                            static_cast<uint64_t>(b.offset));
                    } else {
                        io_uring_prep_read(sqe, b.fd, b.buf, static_cast<unsigned>(b.len),
                                           static_cast<uint64_t>(b.offset));
                    }
                    io_uring_sqe_set_data(sqe, &b);
                    if (prepared == 0) first_prepared = next;
                    ++prepared;
                    ++next;
                    if (config_.single_submit && submit(&prepared, &first_prepared, &in_flight) < 0) break;
                }
            }
            if (prepared > 0) {
                int rc = submit(&prepared, &first_prepared, &in_flight);
                if (rc > 0) {
                    busy_retries = 0;
                } else if ((rc == 0 || rc == -EAGAIN || rc == -EBUSY) && (in_flight > 0 || ++busy_retries <= kMaxBusyRetries)) {
                    if (in_flight == 0) {
                        std::this_thread::sleep_for(std::chrono::milliseconds(1));
                        continue;
                    }
                    // fall through and reap to make room
                } else {
                    if (rc == 0) rc = -EAGAIN;
                    // The ring refuses submissions. Let the kernel finish what it has,
                    // then start a fresh ring so the stuck entries are never submitted.
                    drain(in_flight);
                    in_flight = 0;
                    fail_all(requests, first_prepared, first_prepared + prepared, rc);
                    prepared = 0;
                    reset_ring();
                    if (!ready_) {
                        fail_all(requests, next, n, rc);
                        return;
                    }
                    continue;
                }
            }
            if (in_flight == 0) continue;
            size_t got = harvest(true);
            if (got == static_cast<size_t>(-1)) {  // waiting failed: wait out what is in flight
                drain(in_flight);
                in_flight = 0;
                continue;
            }
            in_flight -= got;
        }
    }

private:
    // Hands prepared entries to the kernel, retrying EINTR. Returns io_uring_submit's result.
    int submit(size_t* prepared, size_t* first_prepared, size_t* in_flight) {
        int rc;
        do {
            rc = io_uring_submit(&ring_);
        } while (rc == -EINTR);
        if (rc > 0) {
            *prepared -= static_cast<size_t>(rc);
            *first_prepared += static_cast<size_t>(rc);
            *in_flight += static_cast<size_t>(rc);
        }
        return rc;
    }

    // Collects available completions; with wait, requests for at least one.
    // Returns the number collected, or (size_t)-1 if waiting failed.
    size_t harvest(bool wait) {
        if (wait) {
            io_uring_cqe* cqe = nullptr;
            int rc;
            do {
                rc = io_uring_wait_cqe(&ring_, &cqe);
            } while (rc == -EINTR);
            if (rc < 0) return static_cast<size_t>(-1);
        }
        size_t count = 0;
        unsigned head;
        io_uring_cqe* cqe;
        io_uring_for_each_cqe(&ring_, head, cqe) {
            Request* b = static_cast<Request*>(io_uring_cqe_get_data(cqe));
            int res = cqe->res;
            // A transient refusal is reported as "nothing transferred": the layer
            // above completes the remainder synchronously.
            b->result = (res == -EAGAIN || res == -EINTR) ? 0 : res;
            ++count;
        }
        io_uring_cq_advance(&ring_, static_cast<unsigned>(count));
        return count;
    }

    // Waits (ignoring wait errors after a bounded number of tries) until the
    // kernel has completed `in_flight` requests; used only on failure paths.
    void drain(size_t in_flight) {
        int failures = 0;
        while (in_flight > 0 && failures < 100) {
            size_t got = harvest(true);
            if (got == static_cast<size_t>(-1)) {
                ++failures;
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
                continue;
            }
            in_flight -= got;
        }
    }

    void reset_ring() {
        io_uring_queue_exit(&ring_);
        ready_ = false;
        std::string what;
        if (init(&what) < 0 && ready_) {
            io_uring_queue_exit(&ring_);
            ready_ = false;
        }
    }

    static void fail_all(Request* requests, size_t from, size_t to, int err) {
        for (size_t i = from; i < to; ++i) {
            requests[i].result = err;
            requests[i].submit_failed = true;
        }
    }

    EngineConfig config_;
    io_uring ring_;
    bool ready_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(const EngineConfig& config, EngineError* error) {
    std::unique_ptr<UringEngine> engine(new UringEngine(config));
    std::string what;
    int rc = engine->init(&what);
    if (rc < 0) {
        error->err = -rc;
        error->message = "io_uring: " + what + " failed: " + platform::errno_text(-rc);
        return nullptr;
    }
    return engine;
}

}  // namespace deepoffload

#endif  // DEEPOFFLOAD_HAVE_URING
