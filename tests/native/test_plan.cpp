// Unit tests of csrc/aio/plan.cpp: shard cuts, aligned middles, request sizes, bounce decisions and request
// splitting, checked for every combination in a grid of offsets, sizes, alignments and thread counts. No IO.
// Usage: test_plan   (prints "N passed, M failed", exits non-zero on failure)
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../../csrc/aio/plan.h"
#include "check.h"

using namespace deepoffload;

namespace {

std::string case_name(int64_t offset, size_t nbytes, size_t off_align, size_t mem_align, int threads) {
    return "offset=" + std::to_string(offset) + " nbytes=" + std::to_string(nbytes) + " off_align=" +
           std::to_string(off_align) + " mem_align=" + std::to_string(mem_align) + " threads=" + std::to_string(threads);
}

// Shards cover the range exactly, in order, without gaps; at most `threads` of them; interior cuts on the unit grid
// from the first aligned byte; every shard but the last one ends aligned, so only the op's own ends are unaligned.
bool shards_are_valid(const std::vector<Span>& shards, int64_t offset, size_t nbytes, size_t off_align,
                      size_t mem_align, int threads, std::string* why) {
    if (nbytes == 0) {
        *why = "non-empty plan for 0 bytes";
        return shards.empty();
    }
    if (shards.empty() || shards.size() > static_cast<size_t>(threads)) {
        *why = std::to_string(shards.size()) + " shards";
        return false;
    }
    const int64_t unit = static_cast<int64_t>(std::max({off_align, mem_align, kShardUnit}));
    const int64_t grid = round_up(offset, static_cast<int64_t>(off_align));
    if (shards.front().begin != offset || shards.back().end != offset + static_cast<int64_t>(nbytes)) {
        *why = "does not cover the range";
        return false;
    }
    for (size_t i = 0; i < shards.size(); ++i) {
        if (shards[i].size() <= 0) {
            *why = "empty shard " + std::to_string(i);
            return false;
        }
        if (i > 0 && shards[i].begin != shards[i - 1].end) {
            *why = "gap or overlap before shard " + std::to_string(i);
            return false;
        }
        if (i > 0 && (shards[i].begin - grid) % unit != 0) {
            *why = "cut " + std::to_string(shards[i].begin) + " is off the unit grid";
            return false;
        }
    }
    return true;
}

void test_shards() {
    const int64_t offsets[] = {0, 1, 511, 4096, 4097, 12345, int64_t(1) << 33};
    const size_t sizes[] = {0, 1, 4095, 4096, 4097, 8192, 65536 + 17, 1000003, size_t(3) << 20};
    const size_t off_aligns[] = {1, 512, 4096, 65536};
    const size_t mem_aligns[] = {1, 512, 4096};
    const int thread_counts[] = {1, 2, 3, 4, 7, 256};
    int bad = 0;
    for (int64_t offset : offsets)
        for (size_t nbytes : sizes)
            for (size_t oa : off_aligns)
                for (size_t ma : mem_aligns)
                    for (int threads : thread_counts) {
                        std::string why;
                        const auto shards = plan_shards(offset, nbytes, oa, ma, threads);
                        if (!shards_are_valid(shards, offset, nbytes, oa, ma, threads, &why)) {
                            if (bad++ < 10) check(false, case_name(offset, nbytes, oa, ma, threads) + ": " + why);
                        }
                    }
    check(bad == 0, "every planned shard set is valid (" + std::to_string(bad) + " invalid)");

    // Enough aligned units: one shard per thread; too few: fewer shards, never an empty one.
    check(plan_shards(0, size_t(4) << 20, 4096, 4096, 4).size() == 4, "4 MiB, 4 threads: 4 shards");
    check(plan_shards(0, 8192, 4096, 4096, 4).size() == 2, "two pages, 4 threads: 2 shards");
    check(plan_shards(100, 200, 4096, 4096, 4).size() == 1, "less than a page: 1 shard");
    // An unaligned head stays with the first shard, whose end is aligned.
    const auto s = plan_shards(100, 3 * 4096, 4096, 1, 2);
    check(s.size() == 2 && s[0].begin == 100 && s[0].end % 4096 == 0, "unaligned head stays in the first shard");
}

void test_aligned_middle() {
    Span shard{100, 200};
    Span mid = aligned_middle(shard, 4096);
    check(mid.size() == 0 && mid.begin >= shard.begin && mid.end <= shard.end, "no aligned middle inside one page");
    mid = aligned_middle(Span{100, 3 * 4096 + 5}, 4096);
    check(mid.begin == 4096 && mid.end == 3 * 4096, "middle of an unaligned span");
    mid = aligned_middle(Span{8192, 8192 + 65536}, 4096);
    check(mid.begin == 8192 && mid.end == 8192 + 65536, "an aligned span is all middle");
    mid = aligned_middle(Span{5, 4096 + 10}, 1);
    check(mid.begin == 5 && mid.end == 4096 + 10, "alignment 1: all middle");
    mid = aligned_middle(Span{4000, 4100}, 4096);
    check(mid.begin == 4096 && mid.end == 4096, "a span across one page boundary has an empty middle");
}

void test_request_size() {
    check(request_size(6000, false, 4096, 4096) == 6000, "buffered: the block size as configured");
    check(request_size(6000, true, 4096, 512) == 4096, "direct: rounded down to the alignment");
    check(request_size(1000, true, 4096, 512) == 4096, "direct: never below one alignment unit");
    check(request_size(size_t(1) << 20, true, 4096, 8192) == size_t(1) << 20, "direct: aligned block size kept");
    check(request_size(12288, true, 4096, 8192) == 8192, "direct: multiple of the larger alignment");
}

void test_bounce() {
    alignas(4096) static char page[8192];
    check(!needs_bounce(true, page, 4096), "aligned memory needs no bounce");
    check(needs_bounce(true, page + 1, 4096), "misaligned memory bounces when direct");
    check(!needs_bounce(false, page + 1, 4096), "buffered IO never bounces");
    check(!needs_bounce(true, page + 512, 512), "memory aligned to the reported alignment needs no bounce");

    BouncePlan p = plan_bounce(size_t(1) << 20, 65536, 4, 512);
    check(p.slot_bytes == 4 * 65536 && p.slots == 2 && p.alignment == kPageSize, "1 MiB: two slots of qd requests");
    p = plan_bounce(65536, 65536, 4, 512);
    check(p.slot_bytes == 4 * 65536 && p.slots == 1, "one wave: one slot");
    p = plan_bounce(size_t(1) << 30, size_t(1) << 20, 32768, 4096);
    check(p.total() <= kMaxBounceBytes && p.slot_bytes % (size_t(1) << 20) == 0, "bounded by kMaxBounceBytes");
    p = plan_bounce(size_t(1) << 30, size_t(64) << 20, 8, 4096);
    check(p.slot_bytes == size_t(64) << 20, "a request larger than the bound still fits one slot");
    p = plan_bounce(100, 4096, 1, 65536);
    check(p.alignment == 65536, "buffer aligned to a larger memory alignment");
}

void test_split() {
    std::vector<Request> requests;
    static char buf[10000];
    split_into_requests(&requests, 7, true, buf, 10000, 4096, 4096);
    bool ok = requests.size() == 3;
    size_t covered = 0;
    for (size_t i = 0; ok && i < requests.size(); ++i) {
        const Request& b = requests[i];
        ok = b.fd == 7 && b.write && b.buf == buf + covered && b.offset == 4096 + static_cast<int64_t>(covered) &&
             b.result == 0 && !b.submit_failed;
        covered += b.len;
    }
    check(ok && covered == 10000 && requests.back().len == 10000 - 2 * 4096, "requests cover the range in order");
    split_into_requests(&requests, 7, false, buf, 0, 0, 4096);
    check(requests.empty(), "nothing to split: no requests");
}

}  // namespace

int main() {
    test_shards();
    test_aligned_middle();
    test_request_size();
    test_bounce();
    test_split();
    return report();
}
