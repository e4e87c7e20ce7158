// Engine registry: which engines are compiled in, and the factory.
#include "engine.h"

#include <cerrno>

namespace deepoffload {

std::vector<std::string> compiled_engines() {
    std::vector<std::string> names;
#ifdef _WIN32
    names.push_back("windows");
#else
#ifdef DEEPOFFLOAD_HAVE_URING
    names.push_back("io_uring");
#endif
#ifdef DEEPOFFLOAD_HAVE_LIBAIO
    names.push_back("libaio");
#endif
    names.push_back("posix");
#endif
    return names;
}

std::unique_ptr<Engine> make_engine(const std::string& name, const EngineConfig& config, EngineError* error) {
#ifdef _WIN32
    if (name == "windows") return make_windows_engine(config, error);
#else
#ifdef DEEPOFFLOAD_HAVE_URING
    if (name == "io_uring") return make_uring_engine(config, error);
#endif
#ifdef DEEPOFFLOAD_HAVE_LIBAIO
    if (name == "libaio") return make_libaio_engine(config, error);
#endif
    if (name == "posix") return make_posix_engine(config, error);
#endif
    error->err = EINVAL;
    error->message = "engine '" + name + "' is not compiled into this build";
    return nullptr;
}

}  // namespace deepoffload
