// Engine registry: the engines compiled into this build, best first, and their factories.
#include "engine.h"

#include <cerrno>

namespace deepoffload {

// Each factory is defined in engine_<name>.cpp, compiled only where its library was found.
#ifdef _WIN32
std::unique_ptr<Engine> make_windows_engine(const EngineConfig& config, EngineError* error);
#else
#ifdef DEEPOFFLOAD_HAVE_URING
std::unique_ptr<Engine> make_uring_engine(const EngineConfig& config, EngineError* error);
#endif
#ifdef DEEPOFFLOAD_HAVE_LIBAIO
std::unique_ptr<Engine> make_libaio_engine(const EngineConfig& config, EngineError* error);
#endif
std::unique_ptr<Engine> make_posix_engine(const EngineConfig& config, EngineError* error);
#endif

const std::vector<EngineEntry>& engine_registry() {
    static const std::vector<EngineEntry> registry = {
#ifdef _WIN32
        {"windows", make_windows_engine},
#else
#ifdef DEEPOFFLOAD_HAVE_URING
        {"io_uring", make_uring_engine},
#endif
#ifdef DEEPOFFLOAD_HAVE_LIBAIO
        {"libaio", make_libaio_engine},
#endif
        {"posix", make_posix_engine},
#endif
    };
    return registry;
}

std::vector<std::string> compiled_engines() {
    std::vector<std::string> names;
    for (const EngineEntry& entry : engine_registry()) names.push_back(entry.name);
    return names;
}

std::unique_ptr<Engine> make_engine(const std::string& name, const EngineConfig& config, EngineError* error) {
    for (const EngineEntry& entry : engine_registry()) {
        if (name == entry.name) return entry.make(config, error);
    }
    error->err = EINVAL;
    error->message = "engine '" + name + "' is not compiled into this build";
    return nullptr;
}

}  // namespace deepoffload
