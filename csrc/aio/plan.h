// Pure planning of one transfer: how it is cut into shards (one per worker thread), which part of a shard can use
// direct IO, how big each engine request is, and whether misaligned memory goes through a bounce buffer. No IO, no
// state: tests/native/test_plan.cpp checks these functions without touching a file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine.h"

namespace deepoffload {

// Direct IO covers whole pages only, even where the kernel accepts 512-byte offsets: a buffered write into a page
// that a concurrent direct write also covers can write the page's stale bytes back over the direct write.
constexpr size_t kPageSize = 4096;
// Shards are cut at multiples of this (or of the alignment, when larger).
constexpr size_t kShardUnit = 4096;
// The most bytes of bounce buffer per worker thread.
constexpr size_t kMaxBounceBytes = size_t(32) << 20;

int64_t round_down(int64_t v, int64_t a);  // a > 0; v >= 0
int64_t round_up(int64_t v, int64_t a);

// A byte range [begin, end) of the file.
struct Span {
    int64_t begin = 0;
    int64_t end = 0;
    int64_t size() const { return end - begin; }
};

// The file-offset alignment direct IO uses for a file whose kernel-reported offset alignment is `reported` bytes.
size_t direct_offset_alignment(size_t reported);

// Cuts [offset, offset + nbytes) into at most `threads` contiguous shards. Interior cuts fall on multiples of
// max(offset_align, memory_align, kShardUnit) counted from the first offset_align-aligned byte, so every shard's
// middle stays aligned; an unaligned head stays with the first shard. Empty when nbytes == 0.
std::vector<Span> plan_shards(int64_t offset, size_t nbytes, size_t offset_align, size_t memory_align, int threads);

// The part of `shard` whose ends are multiples of `offset_align` (possibly empty, then begin == end); the bytes
// before and after it are the unaligned head and tail, done with buffered IO.
Span aligned_middle(Span shard, size_t offset_align);

// Bytes per engine request: the configured request size, rounded down (never below one unit) to a multiple of both
// alignments when the transfer is direct, so every request's memory and file offset stay aligned.
size_t request_size(size_t block_size, bool direct, size_t offset_align, size_t memory_align);

// True when direct IO on `memory` needs the aligned bounce buffer (its address is not a multiple of memory_align).
bool needs_bounce(bool direct, const char* memory, size_t memory_align);

// How a bounced transfer of `nbytes` uses the bounce buffer: `slots` (1 or 2) slots of `slot_bytes` each, filled in
// turn, so one slot is copied while the engine transfers the other.
struct BouncePlan {
    size_t slot_bytes = 0;
    size_t slots = 0;
    size_t alignment = 0;  // of the buffer, bytes
    size_t total() const { return slot_bytes * slots; }
};
BouncePlan plan_bounce(size_t nbytes, size_t request_bytes, int queue_depth, size_t memory_align);

// Fills `out` with requests of at most `request_bytes` covering [buf, buf + len) at file offset `at`.
void split_into_requests(std::vector<Request>* out, int fd, bool write, char* buf, size_t len, int64_t at,
                         size_t request_bytes);

}  // namespace deepoffload
