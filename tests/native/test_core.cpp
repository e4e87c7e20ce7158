// Native tests of the IO core (no Python). Usage: test_core [directory]
// Creates a temporary directory under `directory` (default "."), runs round
// trips and error cases through every compiled-in engine, removes its files,
// prints "N passed, M failed" and exits non-zero on failure.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../csrc/aio/diagnostics.h"
#include "../../csrc/aio/engine.h"
#include "../../csrc/aio/io_handle.h"
#include "../../csrc/aio/platform.h"
#include "check.h"

#if !defined(_WIN32)
#include <signal.h>
#include <sys/time.h>
#endif

using namespace deepoffload;

namespace {

std::string g_dir;
std::vector<std::string> g_files;

std::string temp_path(const std::string& name) {
    std::string p = g_dir + "/" + name;
    g_files.push_back(p);
    return p;
}

// An owned buffer whose data pointer is aligned to 4096 plus `misalign` bytes.
struct Buffer {
    char* base = nullptr;
    char* data = nullptr;
    explicit Buffer(size_t n, size_t misalign = 0) {
        base = static_cast<char*>(platform::aligned_alloc_bytes(4096, n + misalign + 1));
        if (base == nullptr) throw std::runtime_error("out of memory");
        data = base + misalign;
    }
    ~Buffer() { platform::aligned_free(base); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
};

void fill(char* p, size_t n, unsigned seed) {
    unsigned x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; ++i) {
        x = x * 1103515245u + 12345u;
        p[i] = static_cast<char>(x >> 16);
    }
}

OpResult run_op(IoHandle& h, bool write, char* p, size_t n, const std::string& path, int64_t off, unsigned flags,
                int fd = -1) {
    OpResult r;
    h.wait(h.submit(write, p, n, path, fd, off, flags), -1, &r);
    return r;
}

std::string label(const HandleConfig& c, size_t n, int64_t off, size_t mis) {
    return c.engine + " threads=" + std::to_string(c.intra_op_parallelism) + " qd=" + std::to_string(c.queue_depth) +
           " bs=" + std::to_string(c.block_size) + (c.single_submit ? " single" : "") +
           (c.overlap_events ? " overlap" : "") + " n=" + std::to_string(n) + " off=" + std::to_string(off) +
           " misalign=" + std::to_string(mis);
}

int64_t size_of(const std::string& path) {
    int fd = platform::open_file(path, false, false);
    if (fd < 0) return fd;
    int64_t s = platform::file_size(fd);
    platform::close_file(fd);
    return s;
}

void round_trip(IoHandle& h, size_t n, int64_t off, size_t mis, unsigned flags, const std::string& path) {
    const std::string what = label(h.config(), n, off, mis) + " flags=" + std::to_string(flags);
    Buffer out(n, mis), in(n, (mis * 3) % 4096);
    fill(out.data, n, static_cast<unsigned>(n + static_cast<size_t>(off)));
    std::memset(in.data, 0, n);
    OpResult w = run_op(h, true, out.data, n, path, off, flags | kFlagTruncate);
    check(w.err == 0, what + " write: " + w.detail);
    check(size_of(path) == off + static_cast<int64_t>(n), what + " size after truncating write");
    OpResult r = run_op(h, false, in.data, n, path, off, flags);
    check(r.err == 0, what + " read: " + r.detail);
    check(std::memcmp(out.data, in.data, n) == 0, what + " data");
    if (!(flags & kFlagBuffered)) check(w.direct == r.direct, what + " same direct mode");
}

void test_round_trips(const std::string& engine) {
    const size_t sizes[] = {1, 4095, 4096, 1000003, 3 * 65536, 65536 + 4096};
    const int64_t offsets[] = {0, 4096, 777};
    const size_t misaligns[] = {0, 1};
    for (int threads : {1, 2, 4}) {
        HandleConfig c;
        c.engine = engine;
        c.block_size = 65536;
        c.queue_depth = 4;
        c.intra_op_parallelism = threads;
        IoHandle h(c);
        const std::string path = temp_path("rt-" + engine + "-" + std::to_string(threads));
        for (size_t n : sizes)
            for (int64_t off : offsets)
                for (size_t mis : misaligns) round_trip(h, n, off, mis, 0, path);
        round_trip(h, 100000, 333, 0, kFlagBuffered, path);
        round_trip(h, 100000, 0, 0, kFlagFsync, path);
    }
    // Submission modes.
    for (int mode = 0; mode < 4; ++mode) {
        HandleConfig c;
        c.engine = engine;
        c.block_size = 4096;
        c.queue_depth = 8;
        c.single_submit = (mode & 1) != 0;
        c.overlap_events = (mode & 2) != 0;
        c.intra_op_parallelism = 2;
        IoHandle h(c);
        const std::string path = temp_path("mode-" + engine + "-" + std::to_string(mode));
        round_trip(h, 300000, 0, 0, 0, path);
        round_trip(h, 300001, 4096, 3, 0, path);
    }
}

void test_many_in_flight(const std::string& engine) {
    HandleConfig c;
    c.engine = engine;
    c.block_size = 65536;
    c.queue_depth = 8;
    c.intra_op_parallelism = 2;
    IoHandle h(c);
    const int k = 8;
    const size_t n = 500000;
    std::vector<std::unique_ptr<Buffer>> out, in;
    std::vector<int64_t> ids;
    std::vector<std::string> paths;
    for (int i = 0; i < k; ++i) {
        out.emplace_back(new Buffer(n, static_cast<size_t>(i % 2)));
        in.emplace_back(new Buffer(n));
        fill(out.back()->data, n, 1000u + static_cast<unsigned>(i));
        paths.push_back(temp_path("multi-" + engine + "-" + std::to_string(i)));
        ids.push_back(h.submit(true, out.back()->data, n, paths.back(), -1, 0, kFlagTruncate));
    }
    check(h.pending() == static_cast<size_t>(k), engine + " pending() counts uncollected ops");
    for (int i = 0; i < k; ++i) {
        OpResult r;
        h.wait(ids[static_cast<size_t>(i)], -1, &r);
        check(r.err == 0, engine + " concurrent write " + std::to_string(i) + ": " + r.detail);
    }
    ids.clear();
    for (int i = 0; i < k; ++i) ids.push_back(h.submit(false, in[static_cast<size_t>(i)]->data, n, paths[static_cast<size_t>(i)], -1, 0, 0));
    for (int i = k - 1; i >= 0; --i) {  // collect out of order
        OpResult r;
        h.wait(ids[static_cast<size_t>(i)], -1, &r);
        check(r.err == 0 && std::memcmp(out[static_cast<size_t>(i)]->data, in[static_cast<size_t>(i)]->data, n) == 0,
              engine + " concurrent read " + std::to_string(i));
    }
    check(h.pending() == 0, engine + " pending() is 0 after collecting");
    bool threw = false;
    try {
        OpResult r;
        h.wait(ids[0], -1, &r);
    } catch (const std::invalid_argument&) {
        threw = true;
    }
    check(threw, engine + " waiting on a collected op raises invalid_argument");
}

void test_errors(const std::string& engine) {
    HandleConfig c;
    c.engine = engine;
    c.block_size = 65536;
    c.intra_op_parallelism = 2;
    IoHandle h(c);
    Buffer buf(200000);
    fill(buf.data, 200000, 7);

    OpResult r = run_op(h, false, buf.data, 4096, g_dir + "/does-not-exist", 0, 0);
    check(r.err == ENOENT && r.operation == "open", engine + " missing file gives ENOENT/open: " + r.detail);

    const std::string path = temp_path("short-" + engine);
    r = run_op(h, true, buf.data, 100000, path, 0, kFlagTruncate);
    check(r.err == 0, engine + " write 100000");
    for (int64_t off : {int64_t(0), int64_t(4096), int64_t(99999), int64_t(100000), int64_t(500000)}) {
        r = run_op(h, false, buf.data, 200000, path, off, 0);
        check(r.err == ENODATA && r.operation == "read" &&
                  r.detail.find("ends at byte 100000") != std::string::npos,
              engine + " read past end at " + std::to_string(off) + " gives ENODATA: " + r.detail);
    }
    r = run_op(h, false, buf.data, 100000, path, 0, 0);
    check(r.err == 0, engine + " read exactly to end of file");
    r = run_op(h, false, buf.data, 0, path, 0, 0);
    check(r.err == 0, engine + " zero-byte read");

    // Truncate semantics.
    r = run_op(h, true, buf.data, 5000, path, 0, kFlagTruncate);
    check(r.err == 0 && size_of(path) == 5000, engine + " shorter overwrite with TRUNCATE leaves exact size");
    r = run_op(h, true, buf.data, 10, path, 200000, 0);
    check(r.err == 0 && size_of(path) == 200010, engine + " write at offset extends the file");
    r = run_op(h, true, buf.data, 10, path, 0, 0);
    check(r.err == 0 && size_of(path) == 200010, engine + " write without TRUNCATE keeps the size");
    r = run_op(h, true, buf.data, 0, path, 123, kFlagTruncate);
    check(r.err == 0 && size_of(path) == 123, engine + " zero-byte write with TRUNCATE sets the size");

    // Caller-supplied descriptors (buffered and O_DIRECT), not closed by the op.
    for (bool direct : {false, true}) {
        int fd = platform::open_file(path, true, direct);
        if (fd < 0) {
            check(direct, engine + " open fd");
            continue;
        }
        r = run_op(h, true, buf.data + 1, 150001, "", 777, kFlagTruncate, fd);
        check(r.err == 0 && r.direct == direct && size_of(path) == 150778,
              engine + " write through caller fd direct=" + std::to_string(direct) + ": " + r.detail);
        Buffer in(150001);
        int rfd = platform::open_file(path, false, direct);
        r = run_op(h, false, in.data, 150001, "", 777, 0, rfd);
        check(r.err == 0 && std::memcmp(in.data, buf.data + 1, 150001) == 0,
              engine + " read through caller fd direct=" + std::to_string(direct) + ": " + r.detail);
        check(platform::close_file(fd) == 0 && platform::close_file(rfd) == 0, engine + " caller fds stay open");
    }
    r = run_op(h, false, buf.data, 10, "", 12345, 0, 1000000);
    check(r.err == EBADF && r.operation == "open", engine + " bad caller fd gives EBADF: " + r.detail);

    // A full device: ENOSPC must surface (Linux has /dev/full).
    if (platform::path_kind("/dev/full") == 2) {
        r = run_op(h, true, buf.data, 100000, "/dev/full", 0, 0);
        // Linux AIO refuses character devices outright: that must surface too, as EINVAL.
        bool refused = engine == "libaio" && r.err == EINVAL && r.operation == "submit";
        check((r.err == ENOSPC && r.operation == "write") || refused, engine + " write to /dev/full gives ENOSPC: " + r.detail);
    }

    // Timeout and unknown ids.
    OpResult unused;
    bool threw = false;
    try {
        h.wait(987654, 0, &unused);
    } catch (const std::invalid_argument&) {
        threw = true;
    }
    check(threw, engine + " wait on unknown id raises invalid_argument");
}

void test_config_and_lifecycle() {
    const char* bad[] = {"engine", "block_size", "queue_depth", "intra_op_parallelism"};
    for (int i = 0; i < 4; ++i) {
        HandleConfig c;
        if (i == 0) c.engine = "nope";
        if (i == 1) c.block_size = 100;
        if (i == 2) c.queue_depth = 0;
        if (i == 3) c.intra_op_parallelism = 0;
        std::string msg;
        try {
            IoHandle h(c);
        } catch (const std::invalid_argument& e) {
            msg = e.what();
        }
        check(msg.find(bad[i]) != std::string::npos, std::string("bad ") + bad[i] + " raises: " + msg);
    }
    {
        HandleConfig c;
        c.intra_op_parallelism = 1;
        IoHandle h(c);
        Buffer buf(1 << 20);
        const std::string path = temp_path("lifecycle");
        // Leave an op in flight: destruction and close() must wait for it.
        h.submit(true, buf.data, 1 << 20, path, -1, 0, kFlagTruncate);
        h.close();
        h.close();
        check(size_of(path) == (1 << 20), "close waits for in-flight writes");
        bool threw = false;
        try {
            h.submit(true, buf.data, 1, path, -1, 0, 0);
        } catch (const std::runtime_error&) {
            threw = true;
        }
        check(threw, "submit after close raises");
    }
    {
        Buffer buf(1 << 20);  // declared first: it must outlive the handle
        HandleConfig c;
        c.intra_op_parallelism = 3;
        IoHandle h(c);
        h.submit(true, buf.data, 1 << 20, temp_path("dtor"), -1, 0, 0);
    }  // destructor with an op in flight
    check(true, "destructor with an op in flight");

    size_t mem = 0, off = 0;
    bool direct = false;
    check(probe_dio_alignment(g_dir, &mem, &off, &direct) == 0 && mem > 0 && off > 0,
          "dio alignment of the test directory: " + std::to_string(mem) + "/" + std::to_string(off) +
              " direct=" + std::to_string(direct));
    check(probe_dio_alignment(g_dir + "/missing", &mem, &off, &direct) == -ENOENT, "dio alignment of a missing path");
}

#if !defined(_WIN32)
volatile sig_atomic_t g_ticks = 0;
void on_alarm(int) { g_ticks = g_ticks + 1; }

// Runs an engine directly on this thread (workers block signals) under a 1 ms
// SIGALRM installed without SA_RESTART, so every wait can fail with EINTR.
void test_engine_under_signals(const std::string& engine) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    struct sigaction old;
    sigaction(SIGALRM, &sa, &old);
    itimerval tv;
    tv.it_interval.tv_sec = 0;
    tv.it_interval.tv_usec = 1000;
    tv.it_value = tv.it_interval;
    setitimer(ITIMER_REAL, &tv, nullptr);

    const size_t block = 65536, count = 64;
    Buffer out(block * count), in(block * count);
    fill(out.data, block * count, 99);
    const std::string path = temp_path("eintr-" + engine);
    int fd = platform::open_file(path, true, true);
    int rfd = platform::open_file(path, false, true);
    check(fd >= 0 && rfd >= 0, engine + " open for the signal test");
    EngineConfig ec;
    ec.queue_depth = 8;
    EngineError error;
    std::unique_ptr<Engine> e = make_engine(engine, ec, &error);
    check(e != nullptr, engine + " make_engine: " + error.message);
    bool ok = e != nullptr && fd >= 0 && rfd >= 0;
    for (int round = 0; ok && round < 30; ++round) {
        for (bool write : {true, false}) {
            std::vector<Request> requests;
            for (size_t i = 0; i < count; ++i) {
                Request b;
                b.fd = write ? fd : rfd;
                b.write = write;
                b.buf = (write ? out.data : in.data) + i * block;
                b.len = block;
                b.offset = static_cast<int64_t>(i * block);
                requests.push_back(b);
            }
            e->run(requests.data(), requests.size());
            for (const Request& b : requests) ok = ok && b.result == static_cast<int64_t>(block);
        }
        ok = ok && std::memcmp(out.data, in.data, block * count) == 0;
    }
    tv.it_interval.tv_usec = 0;
    tv.it_value = tv.it_interval;
    setitimer(ITIMER_REAL, &tv, nullptr);
    sigaction(SIGALRM, &old, nullptr);
    check(ok, engine + " engine round trips under a 1 ms SIGALRM (" + std::to_string(g_ticks) + " signals)");
    if (fd >= 0) platform::close_file(fd);
    if (rfd >= 0) platform::close_file(rfd);
}
#endif

}  // namespace

int main(int argc, char** argv) {
    const std::string base = argc > 1 ? argv[1] : ".";
    int rc = platform::make_temp_dir(base, "deepoffload-test-", &g_dir);
    if (rc < 0) {
        std::printf("cannot create a temporary directory in %s: %s\n", base.c_str(), platform::errno_text(-rc).c_str());
        return 2;
    }
    std::printf("testing in %s\n", g_dir.c_str());
    try {
        for (const std::string& engine : compiled_engines()) {
            std::string reason;
            bool ok = engine_self_test(engine, g_dir, &reason);
            check(ok, engine + " self test: " + reason);
            std::printf("engine %s: self test %s\n", engine.c_str(), ok ? "ok" : reason.c_str());
            test_round_trips(engine);
            test_many_in_flight(engine);
            test_errors(engine);
#if !defined(_WIN32)
            test_engine_under_signals(engine);
#endif
        }
        test_config_and_lifecycle();
    } catch (const std::exception& e) {
        check(false, std::string("unexpected exception: ") + e.what());
    }
    for (const std::string& f : g_files) platform::remove_path(f);
    rc = platform::remove_path(g_dir);
    check(rc == 0, "temporary directory removed: " + (rc < 0 ? platform::errno_text(-rc) : std::string()));
    return report();
}
