#include "plan.h"

#include <algorithm>

namespace deepoffload {

int64_t round_down(int64_t v, int64_t a) { return v - (v % a); }
int64_t round_up(int64_t v, int64_t a) { return round_down(v + a - 1, a); }

size_t direct_offset_alignment(size_t reported) { return std::max(reported, kPageSize); }

std::vector<Span> plan_shards(int64_t offset, size_t nbytes, size_t offset_align, size_t memory_align, int threads) {
    std::vector<Span> shards;
    if (nbytes == 0) return shards;
    const int64_t begin = offset;
    const int64_t end = offset + static_cast<int64_t>(nbytes);
    const int64_t align = static_cast<int64_t>(offset_align);
    const int64_t unit = std::max<int64_t>({align, static_cast<int64_t>(memory_align), static_cast<int64_t>(kShardUnit)});
    const int64_t mid_begin = std::min(end, round_up(begin, align));
    const int64_t units = (end - mid_begin) / unit;
    const int64_t k = std::max<int64_t>(1, std::min<int64_t>(threads, units));
    for (int64_t i = 0; i < k; ++i) {
        Span s;
        s.begin = i == 0 ? begin : mid_begin + unit * (units * i / k);
        s.end = i == k - 1 ? end : mid_begin + unit * (units * (i + 1) / k);
        shards.push_back(s);
    }
    return shards;
}

Span aligned_middle(Span shard, size_t offset_align) {
    const int64_t align = static_cast<int64_t>(offset_align);
    Span mid;
    mid.begin = std::min(shard.end, round_up(shard.begin, align));
    mid.end = std::max(mid.begin, round_down(shard.end, align));
    return mid;
}

size_t request_size(size_t block_size, bool direct, size_t offset_align, size_t memory_align) {
    if (!direct) return block_size;
    const int64_t grain = static_cast<int64_t>(std::max(offset_align, memory_align));
    return static_cast<size_t>(std::max<int64_t>(grain, round_down(static_cast<int64_t>(block_size), grain)));
}

bool needs_bounce(bool direct, const char* memory, size_t memory_align) {
    return direct && reinterpret_cast<uintptr_t>(memory) % memory_align != 0;
}

BouncePlan plan_bounce(size_t nbytes, size_t request_bytes, int queue_depth, size_t memory_align) {
    const size_t qd = static_cast<size_t>(queue_depth);
    BouncePlan p;
    p.slot_bytes = std::max(request_bytes,
                            std::min(request_bytes * qd, kMaxBounceBytes / 2 / request_bytes * request_bytes));
    p.slots = nbytes > p.slot_bytes ? 2 : 1;
    p.alignment = std::max<size_t>(memory_align, kPageSize);
    return p;
}

void split_into_requests(std::vector<Request>* out, int fd, bool write, char* buf, size_t len, int64_t at,
                         size_t request_bytes) {
    out->clear();
    for (size_t done = 0; done < len; done += request_bytes) {
        Request b;
        b.fd = fd;
        b.write = write;
        b.buf = buf + done;
        b.len = std::min(request_bytes, len - done);
        b.offset = at + static_cast<int64_t>(done);
        out->push_back(b);
    }
}

}  // namespace deepoffload
