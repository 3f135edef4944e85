// The batch of the recurrent layers' ops (trtbuild::GatedDeltaNet, trtbuild::Mamba2Scan): each sequence's state
// slot, past length and tokens, as inputs 8, 9 and 10 give them, and where its state is also kept part-way (the
// optional input 11, state_checkpoints), checked before any state is touched.
#pragma once
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace trtbuild_cpu_ops {

struct StateBatch {
  const int64_t *slots, *past, *starts;
  const int64_t* checkpoints;  // [B, 2]: (new tokens n, slot), or null when the node has no input 11
  int64_t num_seqs;

  // The token after which sequence b's state is also written to checkpoint_slot(b) (-1: none).
  int64_t checkpoint_token(int64_t b) const {
    return checkpoints != nullptr && checkpoints[2 * b] > 0 ? starts[b] + checkpoints[2 * b] - 1 : -1;
  }
  int64_t checkpoint_slot(int64_t b) const { return checkpoints[2 * b + 1]; }
};

// Copy `count` floats of a head's state into the same head of another slot (a checkpoint).
inline void copy_state(const float* from, float* to, int64_t count) { std::copy(from, from + count, to); }

// `fail` reports a bad input (it throws). `tokens`: the step's T; `num_slots`: recurrent_state's first dimension.
template <typename Fail>
StateBatch state_batch(Ort::KernelContext& ctx, int64_t tokens, int64_t num_slots, Fail fail) {
  const auto shape_of = [&](size_t i) { return ctx.GetInput(i).GetTensorTypeAndShapeInfo().GetShape(); };
  const std::vector<int64_t> slots_shape = shape_of(8);
  if (slots_shape.size() != 1) fail("state_slots must be [B]");
  const int64_t num_seqs = slots_shape[0];
  if (shape_of(9) != std::vector<int64_t>{num_seqs}) fail("past_lengths must be [B], B state_slots' entries");
  if (shape_of(10) != std::vector<int64_t>{num_seqs + 1}) fail("query_start_loc must be [B + 1]");
  const int64_t* checkpoints = nullptr;
  if (ctx.GetInputCount() > 11 && static_cast<const OrtValue*>(ctx.GetInput(11)) != nullptr) {
    if (shape_of(11) != std::vector<int64_t>{num_seqs, 2}) fail("state_checkpoints must be [B, 2]");
    checkpoints = ctx.GetInput(11).GetTensorData<int64_t>();
  }
  const StateBatch batch{ctx.GetInput(8).GetTensorData<int64_t>(), ctx.GetInput(9).GetTensorData<int64_t>(),
                         ctx.GetInput(10).GetTensorData<int64_t>(), checkpoints, num_seqs};
  std::vector<int64_t> seen;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (batch.starts[b] < 0 || batch.starts[b + 1] < batch.starts[b] || batch.starts[b + 1] > tokens)
      fail("query_start_loc is not ascending within [0, T]");
    if (batch.slots[b] < 0 || batch.slots[b] >= num_slots) fail("a state slot is outside recurrent_state");
    if (batch.past[b] < 0) fail("a past length is negative");
    seen.push_back(batch.slots[b]);
  }
  for (int64_t b = 0; checkpoints != nullptr && b < num_seqs; ++b) {
    if (checkpoints[2 * b] <= 0) continue;
    if (checkpoints[2 * b] > batch.starts[b + 1] - batch.starts[b])
      fail("a state checkpoint comes after more tokens than its sequence has");
    if (checkpoints[2 * b + 1] < 0 || checkpoints[2 * b + 1] >= num_slots)
      fail("a state checkpoint's slot is outside recurrent_state");
    seen.push_back(checkpoints[2 * b + 1]);
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) fail("two sequences (or checkpoints) share a state slot");
  if (num_seqs > 0 && (batch.starts[0] != 0 || batch.starts[num_seqs] != tokens))
    fail("query_start_loc does not cover every token");
  return batch;
}

}  // namespace trtbuild_cpu_ops
