// The narrow engine interface: perform a batch of (fd, buffer, length, offset)
// transfers with up to queue_depth in flight. Splitting, alignment, bounce
// buffers and error reporting live above this, in io_handle.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace deepoffload {

// The defaults of every setting, written once: IoHandle and the binding (which exports them as DEFAULTS) use these.
struct EngineConfig {
    size_t block_size = 1 << 20;  // bytes per request (the name is DeepSpeed's config key)
    int queue_depth = 32;         // requests in flight per engine instance
    bool single_submit = false;   // one request per submission call
    bool overlap_events = true;   // refill the queue as completions arrive
};

struct Request {
    int fd = -1;
    bool write = false;
    char* buf = nullptr;
    size_t len = 0;
    int64_t offset = 0;
    // Set by Engine::run: bytes transferred (may be short) or -errno.
    int64_t result = 0;
    // Set by Engine::run when result < 0 came from submitting, not from the IO.
    bool submit_failed = false;
};

class Engine {
public:
    virtual ~Engine() = default;
    virtual const char* name() const = 0;
    // Performs all n requests and sets each request's result. Never throws.
    virtual void run(Request* requests, size_t n) = 0;
};

struct EngineError {
    int err = 0;          // errno
    std::string message;  // what failed, with errno text
};

// Creates an engine instance; returns nullptr and fills *error on failure.
using EngineFactory = std::unique_ptr<Engine> (*)(const EngineConfig& config, EngineError* error);

struct EngineEntry {
    const char* name;
    EngineFactory make;
};

// The engines compiled into this build, best first: the one table (engine.cpp) that every list of engines derives
// from. Adding an engine is one engine_<name>.cpp plus one row there.
const std::vector<EngineEntry>& engine_registry();

// The registry's names, best first (e.g. io_uring, libaio, posix); the last is the portable engine.
std::vector<std::string> compiled_engines();

// The registry's factory for `name`; returns nullptr and fills *error when `name` is not compiled in or fails.
std::unique_ptr<Engine> make_engine(const std::string& name, const EngineConfig& config, EngineError* error);

}  // namespace deepoffload
