// A read of KV blocks in a block table's order, each block front to back, doing nothing else: the bound that
// decode attention's access pattern sets, which benchmarks/attention.py puts beside a sequential pass over the same
// bytes. A block is 16 tokens' K (or V) of one layer, 6 KiB at SmolLM2's heads in bf16: the hardware prefetchers
// restart at every scattered block, so in random order such a read streams well under a sequential one (RESULTS.md,
// "Decode attention against what its blocks allow"). Plain C ABI; paged_backend/ops/cpu.py's `read_blocks` mirrors it.

#include <cstdint>

#include <omp.h>

namespace {

// The wrapping sum of a block's 32-bit words, so the reads cannot be optimized away and a test can check them.
uint32_t block_words(const uint32_t* words, int64_t count) {
  uint32_t total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < count; ++i) total += words[i];
  return total;
}

}  // namespace

extern "C" {

// Reads blocks[0..count) of both contiguous pools in order, K block then V block, each `block_bytes` long (a
// multiple of 4), split over `num_threads` in contiguous runs of the table. Returns the wrapping sum of
// every 32-bit word read.
uint32_t pb_cpu_read_blocks(const void* key_pool, const void* value_pool, const int32_t* blocks, int64_t count,
                            int64_t block_bytes, int32_t num_threads) {
  const char* keys = static_cast<const char*>(key_pool);
  const char* values = static_cast<const char*>(value_pool);
  const int64_t words = block_bytes / 4;
  uint32_t total = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : total)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t offset = blocks[i] * block_bytes;
    total += block_words(reinterpret_cast<const uint32_t*>(keys + offset), words);
    total += block_words(reinterpret_cast<const uint32_t*>(values + offset), words);
  }
  return total;
}

}  // extern "C"
