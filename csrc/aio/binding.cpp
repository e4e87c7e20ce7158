// Python binding: raw pointers and sizes in, errno tuples out. Python validates
// tensors and keeps buffers alive until wait() returns their result.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>

#include "engine.h"
#include "diagnostics.h"
#include "io_handle.h"

namespace py = pybind11;
using deepoffload::HandleConfig;
using deepoffload::IoHandle;
using deepoffload::OpResult;

namespace {

std::unique_ptr<IoHandle> make_handle(const std::string& engine, int64_t block_size, int queue_depth,
                                      bool single_submit, bool overlap_events, int intra_op_parallelism) {
    if (block_size <= 0) throw std::invalid_argument("block_size must be > 0 bytes, got " + std::to_string(block_size));
    HandleConfig config;
    config.engine = engine;
    config.block_size = static_cast<size_t>(block_size);
    config.queue_depth = queue_depth;
    config.single_submit = single_submit;
    config.overlap_events = overlap_events;
    config.intra_op_parallelism = intra_op_parallelism;
    return std::unique_ptr<IoHandle>(new IoHandle(config));
}

// Runs fn() with the GIL released. Not py::gil_scoped_release: at interpreter exit, a daemon thread that takes the
// GIL back is ended by pthread_exit, whose forced unwind out of that guard's (noexcept) destructor would call
// the C++ runtime's terminate handler ("terminate called without an active exception"); a plain call unwinds cleanly.
template <typename F>
bool without_gil(F&& fn) {
    PyThreadState* state = PyEval_SaveThread();
    bool result;
    try {
        result = fn();
    } catch (...) {
        PyEval_RestoreThread(state);
        throw;
    }
    PyEval_RestoreThread(state);
    return result;
}

// Text that may hold a path: bytes that are not UTF-8 come back as Python's os.fsdecode() gives them.
py::str path_text(const std::string& s) {
    return py::reinterpret_steal<py::str>(
        PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape"));
}

py::object wait_op(IoHandle& handle, int64_t op_id, double timeout_s) {
    OpResult r;
    const bool finished = without_gil([&] { return handle.wait(op_id, timeout_s, &r); });
    if (!finished) return py::none();
    return py::make_tuple(r.err, r.operation, path_text(r.path), r.offset, path_text(r.detail), r.direct);
}

int64_t submit_op(IoHandle& handle, bool write, uintptr_t ptr, int64_t nbytes, const std::string& path, int fd,
                  int64_t offset, int64_t flags) {
    if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0, got " + std::to_string(nbytes));
    if (flags < 0) throw std::invalid_argument("flags must be >= 0, got " + std::to_string(flags));
    return handle.submit(write, reinterpret_cast<char*>(ptr), static_cast<size_t>(nbytes), path, fd, offset,
                         static_cast<unsigned>(flags));
}

py::tuple dio_alignment(const std::string& path) {
    size_t memory = 0, offset = 0;
    bool supported = false;
    int rc = deepoffload::probe_dio_alignment(path, &memory, &offset, &supported);
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
        throw py::error_already_set();
    }
    return py::make_tuple(memory, offset, supported);
}

py::tuple self_test(const std::string& engine, const std::string& directory) {
    std::string reason;
    const bool ok = without_gil([&] { return deepoffload::engine_self_test(engine, directory, &reason); });
    return py::make_tuple(ok, reason);
}

// What this build contains: the engines (from the registry, best first) and how libaio reaps completions.
py::dict build_features() {
    py::dict d;
    d["engines"] = deepoffload::compiled_engines();
#if defined(DEEPOFFLOAD_HAVE_LIBAIO) && defined(DEEPOFFLOAD_HAVE_PGETEVENTS)
    d["reap"] = "io_pgetevents";
#elif defined(DEEPOFFLOAD_HAVE_LIBAIO)
    d["reap"] = "io_getevents";
#else
    d["reap"] = "none";
#endif
    return d;
}

// The handle's defaults as C++ defines them (HandleConfig, EngineConfig), keyed by the Handle's argument names.
py::dict handle_defaults() {
    const HandleConfig c;
    py::dict d;
    d["engine"] = c.engine;
    d["block_size"] = c.block_size;
    d["queue_depth"] = c.queue_depth;
    d["single_submit"] = c.single_submit;
    d["overlap_events"] = c.overlap_events;
    d["intra_op_parallelism"] = c.intra_op_parallelism;
    return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "deepoffload native async IO core";
    // An engine or thread that cannot start (a resource limit, a missing kernel feature) is an OSError with errno.
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const std::system_error& e) {
            py::tuple args = py::make_tuple(e.code().value(), e.what());
            PyErr_SetObject(PyExc_OSError, args.ptr());
        }
    });
    m.attr("TRUNCATE") = static_cast<int>(deepoffload::kFlagTruncate);
    m.attr("BUFFERED") = static_cast<int>(deepoffload::kFlagBuffered);
    m.attr("FSYNC") = static_cast<int>(deepoffload::kFlagFsync);
    m.attr("DEFAULTS") = handle_defaults();

    m.def("engines", &deepoffload::compiled_engines, "Compiled-in engines, best first.");
    m.def("build_features", &build_features, "{'engines': compiled-in engines best first, 'reap': how libaio reaps completions}.");
    m.def("self_test", &self_test, py::arg("engine"), py::arg("directory"),
          "O_DIRECT write+read round trip of a temporary file in directory: (ok, reason).");
    m.def("dio_alignment", &dio_alignment, py::arg("path"),
          "(memory_alignment, offset_alignment, direct_supported) in bytes for an existing file or directory.");

    const HandleConfig defaults;
    py::class_<IoHandle>(m, "Handle")
        .def(py::init(&make_handle), py::arg("engine") = defaults.engine,
             py::arg("block_size") = static_cast<int64_t>(defaults.block_size),
             py::arg("queue_depth") = defaults.queue_depth, py::arg("single_submit") = defaults.single_submit,
             py::arg("overlap_events") = defaults.overlap_events,
             py::arg("intra_op_parallelism") = defaults.intra_op_parallelism)
        .def("submit", &submit_op, py::arg("write"), py::arg("ptr"), py::arg("nbytes"), py::arg("path"),
             py::arg("fd"), py::arg("offset"), py::arg("flags"),
             "Queue a read or write of nbytes at ptr; returns the op id. Never blocks on IO.")
        .def("wait", &wait_op, py::arg("op_id"), py::arg("timeout_s") = -1.0,
             "(errno, operation, path, offset, detail, direct) or None on timeout; releases the GIL.")
        .def("done", &IoHandle::done, py::arg("op_id"))
        .def("pending", &IoHandle::pending)
        .def("close", [](IoHandle& h) { without_gil([&] { return h.close(), true; }); })
        .def_property_readonly("engine", [](IoHandle& h) { return h.config().engine; })
        .def_property_readonly("block_size", [](IoHandle& h) { return h.config().block_size; })
        .def_property_readonly("queue_depth", [](IoHandle& h) { return h.config().queue_depth; })
        .def_property_readonly("single_submit", [](IoHandle& h) { return h.config().single_submit; })
        .def_property_readonly("overlap_events", [](IoHandle& h) { return h.config().overlap_events; })
        .def_property_readonly("intra_op_parallelism", [](IoHandle& h) { return h.config().intra_op_parallelism; });
}
