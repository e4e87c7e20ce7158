// The native test programs' tally: check() counts a pass or prints the failure; report() prints the closing
// "N passed, M failed" line and returns the exit status.
#pragma once

#include <cstdio>
#include <string>

namespace check_tally {
inline int passed = 0;
inline int failed = 0;
}  // namespace check_tally

inline void check(bool ok, const std::string& what) {
    if (ok) {
        ++check_tally::passed;
    } else {
        ++check_tally::failed;
        std::printf("FAIL: %s\n", what.c_str());
    }
}

inline int report() {
    std::printf("%d passed, %d failed\n", check_tally::passed, check_tally::failed);
    return check_tally::failed == 0 ? 0 : 1;
}
