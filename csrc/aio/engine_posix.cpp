// Portable engine: synchronous pread/pwrite, one request after another.
// (platform_posix.cpp supplies the EINTR and short-transfer loops.)
#include "engine.h"
#include "platform.h"

namespace deepoffload {

namespace {

class PosixEngine final : public Engine {
public:
    const char* name() const override { return "posix"; }

    void run(Request* requests, size_t n) override {
        for (size_t i = 0; i < n; ++i) {
            Request& b = requests[i];
            b.submit_failed = false;
            b.result = b.write ? platform::pwrite_full(b.fd, b.buf, b.len, b.offset)
                               : platform::pread_full(b.fd, b.buf, b.len, b.offset);
        }
    }
};

}  // namespace

std::unique_ptr<Engine> make_posix_engine(const EngineConfig&, EngineError*) {
    return std::unique_ptr<Engine>(new PosixEngine());
}

}  // namespace deepoffload
