// How fast trtbuild::DenseMatMul's tile (cpu_ops/dense_matmul.cc: 8 tokens x 32 rows of float16 weights, each
// 16-weight vector widened to float32 and multiplied by one token's activation broadcast) can run on this machine,
// by where its weights come from: registers only (the FMA peak), L1, a 27.5 MB matrix (the last-level cache of
// large server parts) and 1.8 GB (memory, as in a decode step), the last without and with a software prefetch
// 2 KiB ahead; and the rate the threads can read that 1.8 GB at with no compute at all (what batch-1 decode, one
// pass over the weights per token, is bound by). Threads split the rows; rounds alternate; medians.
//
//     g++ -O3 -march=native -pthread benchmarks/dense_tile_ceilings.cc -o /tmp/ceilings && /tmp/ceilings [threads]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kRows = 16;  // rows per group, one per float32 lane
constexpr int kTokens = 8, kGroups = 2;
volatile float g_sink;  // keeps the FMA chains' results alive

struct Matrix {
  int64_t m, k, n;
  std::vector<float> x, y;
  std::vector<uint16_t> w;  // [n / 16, k, 16] float16
  Matrix(int64_t m_, int64_t k_, int64_t n_)
      : m(m_), k(k_), n(n_), x(m_ * k_, 0.01f), y(m_ * n_), w(n_ * k_, 0x3c00 /* 1.0 */) {}
};

template <bool PREFETCH>
void tile(Matrix& a, int64_t g, int64_t t0) {
  const float* x = a.x.data() + t0 * a.k;
  __m512 acc[kTokens][kGroups];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < a.k; ++i) {
    __m512 w[kGroups];
    for (int r = 0; r < kGroups; ++r) {
      const uint16_t* at = a.w.data() + ((g + r) * a.k + i) * kRows;
      w[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(at) + 2048, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      const __m512 xv = _mm512_set1_ps(x[t * a.k + i]);
      for (int r = 0; r < kGroups; ++r) acc[t][r] = _mm512_fmadd_ps(w[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < kTokens; ++t)
    for (int r = 0; r < kGroups; ++r) _mm512_storeu_ps(a.y.data() + (t0 + t) * a.n + (g + r) * kRows, acc[t][r]);
}

// GFLOP/s of `calls` passes over the matrix, each thread taking a contiguous share of its groups
template <bool PREFETCH>
double matmul_rate(Matrix& a, int threads, int calls) {
  const int64_t groups = a.n / kRows, share = groups / threads / kGroups * kGroups;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int th = 0; th < threads; ++th)
    pool.emplace_back([&, th] {
      for (int c = 0; c < calls; ++c)
        for (int64_t g = th * share; g < (th + 1) * share; g += kGroups)
          for (int64_t t = 0; t + kTokens <= a.m; t += kTokens) tile<PREFETCH>(a, g, t);
    });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 2.0 * a.m * a.k * share * threads * kRows * calls / s / 1e9;
}

double fma_peak(int threads) {
  constexpr long kIters = 100000000;
  std::vector<float> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int th = 0; th < threads; ++th)
    pool.emplace_back([&, th] {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(i * 1e-3f);
      const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
      for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], b, c);
      }
      __m512 s = acc[0];
      for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
      sink[th] = _mm512_reduce_add_ps(s);
    });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  g_sink = sink[0];
  return 2.0 * 16 * 16 * kIters * threads / s / 1e9;
}

// GB/s of one pass reading the matrix's weights, each thread summing a contiguous share (the sum is discarded)
double read_rate(const Matrix& a, int threads) {
  const size_t bytes = a.w.size() * sizeof(uint16_t), share = bytes / threads / 256 * 256;
  std::vector<float> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int th = 0; th < threads; ++th)
    pool.emplace_back([&, th] {
      const char* at = reinterpret_cast<const char*>(a.w.data()) + th * share;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (size_t i = 0; i < share; i += 256)
        for (int j = 0; j < 4; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(at + i + 64 * j));
      sink[th] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  g_sink = sink[0];
  return share * threads / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  Matrix l1(16, 256, 32 * threads), llc(16, 1536, 8960), memory(16, 1536, 8960 * 64);
  const std::vector<std::pair<const char*, std::function<double()>>> cases = {
      {"FMA peak (registers only)", [&] { return fma_peak(threads); }},
      {"tile, weights in L1 (K=256, 2 groups a thread)", [&] { return matmul_rate<false>(l1, threads, 40000); }},
      {"tile, one 27.5 MB matrix (K=1536, N=8960)", [&] { return matmul_rate<false>(llc, threads, 40); }},
      {"tile, 1.8 GB from memory", [&] { return matmul_rate<false>(memory, threads, 1); }},
      {"tile, 1.8 GB from memory, prefetch 2 KiB ahead", [&] { return matmul_rate<true>(memory, threads, 1); }},
      {"read 1.8 GB, no compute (GB/s, not GFLOP/s)", [&] { return read_rate(memory, threads); }},
  };
  constexpr int kRounds = 5;
  std::vector<std::vector<double>> rates(cases.size());
  for (int round = 0; round < kRounds; ++round)
    for (size_t i = 0; i < cases.size(); ++i) {
      const size_t c = (i + round) % cases.size();  // each round starts with the next case
      rates[c].push_back(cases[c].second());
    }
  std::printf("%d threads, 16 tokens, float16 weights, %d alternated rounds, median GFLOP/s (min-max)\n", threads,
              kRounds);
  for (size_t c = 0; c < cases.size(); ++c) {
    std::sort(rates[c].begin(), rates[c].end());
    std::printf("  %-50s %6.0f  (%.0f-%.0f)\n", cases[c].first, rates[c][kRounds / 2], rates[c].front(),
                rates[c].back());
  }
}
