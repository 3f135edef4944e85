// PagedAttention's unit of work (cpu_ops/paged_attention.cc): one step's inputs, and one task's share of them.
// NOTE: a step of few tokens over long contexts (batch-1 decode) splits each token's keys into `splits` ranges, one
// task each (flash-decoding), rather than its query heads: tasks that split the heads would each read all the keys
// and values. A range's output is normalized by its own softmax sum and comes with its log-sum-exp; combine_ranges
// weighs the ranges (and adds the sink) afterwards.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace trtbuild_cpu_ops::attention {
struct Step {
  const float* q;       // [T, H, D], rotated
  const void* k_new;    // [T, KVH, D], rotated, of the pool's element type
  const void* v_new;    // [T, KVH, D], of the pool's element type
  const void* pool;     // [NB, L, 2, KVH, BS, D], float or float16 (uint16_t bits)
  bool half;            // the pool (and k_new, v_new) hold float16
  const int64_t* block_tables;
  const int64_t* past;
  const int64_t* starts;
  const int64_t* seq_of_token;
  float* out;  // [T, H, D]
  int64_t heads, kv_heads, d, bs, layers, layer, width;
  int64_t window;  // a query sees its last `window` keys (itself included); 0: all of them
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) before softmax; 0: none
  const float* sinks;  // [H]: each query head's sink logit (not soft-capped); null: none
  int64_t heads_per_task;  // query heads of one KV head that one task computes, reading each key and value once
  int64_t tokens;          // T
  int64_t splits;          // key ranges of each (token, KV head, heads): 1, or more (then the two below)
  float* range_out;        // [splits, T, H, D]: each range's output
  float* range_lse;        // [splits, T, H]: each range's log-sum-exp of its scores; -inf for an empty range
};

// What one task reads: new token t's query heads h0 .. h0 + nh - 1 of KV head g, and its visible keys and values
// (the sequence's past ones in the pool, then its new ones up to t): keys first .. visible - 1, all but the oldest
// ones with a sliding window, or one range of those.
struct Task {
  const Step& s;
  int64_t t, g, h0, nh, b, past, start, visible, first;
  float* output;  // [nh, D]
  float* lse;     // [nh]: a range's log-sum-exp per head; null without ranges

  Task(const Step& step, size_t task) : s(step) {
    const int64_t group = s.heads / s.kv_heads, chunks = (group + s.heads_per_task - 1) / s.heads_per_task;
    const int64_t range = static_cast<int64_t>(task) % s.splits, unit = static_cast<int64_t>(task) / s.splits;
    t = unit / (s.kv_heads * chunks);
    g = unit / chunks % s.kv_heads;
    h0 = g * group + unit % chunks * s.heads_per_task;
    nh = std::min(s.heads_per_task, (g + 1) * group - h0);
    b = s.seq_of_token[t], past = s.past[b], start = s.starts[b];
    visible = past + t - start + 1;
    first = s.window > 0 ? std::max<int64_t>(0, visible - s.window) : 0;
    output = s.out + (t * s.heads + h0) * s.d;
    lse = nullptr;
    if (s.splits > 1) {
      const int64_t keys = visible - first;
      visible = first + keys * (range + 1) / s.splits;
      first += keys * range / s.splits;
      output = s.range_out + ((range * s.tokens + t) * s.heads + h0) * s.d;
      lse = s.range_lse + (range * s.tokens + t) * s.heads + h0;
    }
  }

  template <typename T>
  const T* row(int64_t j, int64_t which) const {  // key (which 0) or value (1) j
    const int64_t d = s.d, head_stride = s.bs * d, kv_stride = s.kv_heads * head_stride;  // within (block, layer)
    if (j < past)
      return static_cast<const T*>(s.pool) + s.block_tables[b * s.width + j / s.bs] * (s.layers * 2 * kv_stride) +
             (s.layer * 2 + which) * kv_stride + g * head_stride + (j % s.bs) * d;
    return static_cast<const T*>(which ? s.v_new : s.k_new) + ((start + j - past) * s.kv_heads + g) * d;
  }

  // keys[j] and values[j]: the rows of keys first + j (j < visible - first)
  template <typename T>
  void rows(const T** keys, const T** values) const {
    for (int64_t j = 0; j < visible - first; ++j) {  // NOTE: one block-table lookup (and division) per block
      const int64_t key = first + j;
      const bool next_in_block = j > 0 && key < past && key % s.bs;
      keys[j] = next_in_block ? keys[j - 1] + s.d : row<T>(key, 0);
      values[j] = next_in_block ? values[j - 1] + s.d : row<T>(key, 1);
    }
  }

  const float* queries() const { return s.q + (t * s.heads + h0) * s.d; }
  float* out() const { return output; }
};

// 1 / the softmax denominator of this task's head h (0 .. nh - 1), whose largest score is `max_score`;
// `sum_exp(m)` stores exp(score - m) in place of each score and returns their sum. A sink is one more score without
// a value: the maximum is the larger of the two, and exp(sink - maximum) joins the sum. A range's task records its
// log-sum-exp and leaves the sink to combine_ranges.
template <typename SumExp>
inline float inverse_denominator(const Task& a, int64_t h, float max_score, SumExp sum_exp) {
  if (a.lse != nullptr) {
    const float sum = sum_exp(max_score);
    a.lse[h] = max_score + std::log(sum);
    return 1.0f / sum;
  }
  if (a.s.sinks == nullptr) return 1.0f / sum_exp(max_score);
  const float sink = a.s.sinks[a.h0 + h], top = std::max(max_score, sink);
  return 1.0f / (sum_exp(top) + std::exp(sink - top));
}
}  // namespace trtbuild_cpu_ops::attention
