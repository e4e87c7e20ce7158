// One checked expectation for every error path of the core: DEEPOFFLOAD_EXPECT(condition, exception) throws the
// exception when the condition is false. Operations fail with OpFailure, which the worker turns into the op's
// result (operation, path, offset, errno); nothing in the core aborts the process.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <utility>

namespace deepoffload {

// A failed step of one op: errno, the step ("open", "write", ...), the file offset it concerns and what happened.
struct OpFailure : std::exception {
    int err;
    const char* operation;
    int64_t offset;
    std::string detail;

    OpFailure(int err_, const char* operation_, int64_t offset_, std::string detail_)
        : err(err_), operation(operation_), offset(offset_), detail(std::move(detail_)) {}
    const char* what() const noexcept override { return detail.c_str(); }
};

}  // namespace deepoffload

// The exception expression is evaluated only when the condition fails.
#define DEEPOFFLOAD_EXPECT(condition, ...) \
    do {                                    \
        if (!(condition)) throw __VA_ARGS__; \
    } while (0)
