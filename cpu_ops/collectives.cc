// trtbuild::AllReduce and trtbuild::AllGather for ONNX Runtime's CPU provider: the collectives of a tensor-parallel
// engine's ranks, one process each, meeting in a POSIX shared-memory channel that the runtime creates
// (runtime/tensor_parallel.py: Channel, which writes the header below).
//   AllReduce: x float [...] -> y float [...], the sum of every rank's x, added in rank order (so every rank holds
//     the same bits).
//   AllGather: x float [R, C] -> y float [R, world * C], rank r's x in columns r * C .. (r + 1) * C.
//   inputs: x, then tp_group int64 [1] (the channel's id: its name is "/trtbuild-tp-<id in hex>").
//   attributes: rank, world_size.
// A tensor larger than a slot goes through in pieces. Each piece: every rank writes its slot of one of two buffers
// (alternating, so one barrier per piece suffices: a rank rewrites a buffer only after every rank has passed the
// barrier of the piece after the one that last used it), waits at the barrier, then reads all slots.
#include "cpu_ops.h"

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace trtbuild_cpu_ops {
namespace {

constexpr uint32_t kMagic = 0x48435054;  // "TPCH"
constexpr uint32_t kVersion = 1;
constexpr int64_t kSlotHeader = 64;  // each slot: the piece's tag and element count, then its floats

// The channel's first 4096 bytes; the slots follow: buffer b, rank r at 4096 + (b * world + r) * slot_bytes.
struct Header {
  uint32_t magic, version, world, broken;  // broken: set by the runtime when a rank's process is gone or failed
  uint64_t slot_bytes;
  uint32_t timeout_ms;  // how long a rank waits at a barrier for the others
  alignas(64) uint32_t arrived;
  alignas(64) uint32_t generation;
};
constexpr int64_t kHeaderBytes = 4096;

struct SlotHead {
  uint64_t tag;
  int64_t count;
};

class Channel {
 public:
  Channel(int64_t id, int64_t world) {
    char name[64];
    snprintf(name, sizeof name, "/trtbuild-tp-%llx", static_cast<unsigned long long>(id));
    const int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) throw std::runtime_error(std::string("tensor-parallel channel ") + name + " cannot be opened");
    struct stat st;
    fstat(fd, &st);
    bytes_ = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("tensor-parallel channel ") + name + " cannot be mapped");
    base_ = static_cast<char*>(p);
    header_ = reinterpret_cast<Header*>(base_);
    if (header_->magic != kMagic || header_->version != kVersion || header_->world != world ||
        bytes_ < kHeaderBytes + 2 * world * header_->slot_bytes) {
      munmap(base_, bytes_);
      throw std::runtime_error(std::string("tensor-parallel channel ") + name + " is not one of " +
                               std::to_string(world) + " ranks of this trtbuild version");
    }
  }
  ~Channel() { munmap(base_, bytes_); }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int64_t slot_floats() const { return (static_cast<int64_t>(header_->slot_bytes) - kSlotHeader) / 4; }

  // The slot of `rank` in the buffer of the next piece.
  char* slot(int64_t buffer, int64_t rank) const {
    return base_ + kHeaderBytes + (buffer * header_->world + rank) * static_cast<int64_t>(header_->slot_bytes);
  }

  int64_t next_buffer() { return pieces_++ % 2; }

  void barrier(const std::string& node) {
    const uint32_t generation = __atomic_load_n(&header_->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&header_->arrived, 1, __ATOMIC_ACQ_REL) == header_->world) {
      __atomic_store_n(&header_->arrived, 0, __ATOMIC_RELAXED);
      __atomic_store_n(&header_->generation, generation + 1, __ATOMIC_RELEASE);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t i = 0;; ++i) {
      if (__atomic_load_n(&header_->generation, __ATOMIC_ACQUIRE) != generation) return;
      if (__atomic_load_n(&header_->broken, __ATOMIC_RELAXED))
        throw std::runtime_error(node + ": a tensor-parallel rank stopped; the engine must be restarted");
      if (i < 4096) {
        _mm_pause();
        continue;
      }
      // NOTE: yield once the wait is long: ranks may share cores with each other's threads
      sched_yield();
      if (i % 1024 == 0 && std::chrono::steady_clock::now() - start > std::chrono::milliseconds(header_->timeout_ms))
        throw std::runtime_error(node + ": the other tensor-parallel ranks did not arrive within " +
                                 std::to_string(header_->timeout_ms / 1000.0) + " s");
    }
  }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
  Header* header_ = nullptr;
  uint64_t pieces_ = 0;
};

// The channels this process has mapped, each once however many nodes use it, and unmapped when the last kernel
// using it goes (its session closed): a process that opens engine after engine keeps none of their channels.
class Channels {
 public:
  static Channel* acquire(int64_t id, int64_t world) {
    std::lock_guard<std::mutex> lock(mutex());
    auto it = map().find(id);
    if (it == map().end()) it = map().emplace(id, Entry{new Channel(id, world), 0}).first;
    ++it->second.users;
    return it->second.channel;
  }

  static void release(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex());
    auto it = map().find(id);
    if (it != map().end() && --it->second.users == 0) {
      delete it->second.channel;
      map().erase(it);
    }
  }

 private:
  struct Entry {
    Channel* channel;
    int64_t users;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<int64_t, Entry>& map() {
    static std::map<int64_t, Entry> m;
    return m;
  }
};

struct CollectiveKernel {
  const int64_t rank, world;
  const std::string node;
  const uint64_t node_tag;
  Channel* channel_ = nullptr;  // acquired on the first step, released with the kernel
  int64_t channel_id_ = 0;

  explicit CollectiveKernel(const OrtKernelInfo* info)
      : rank(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("rank")),
        world(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("world_size")),
        node(Ort::ConstKernelInfo(info).GetNodeName()),
        node_tag(std::hash<std::string>{}(node)) {
    if (world < 2 || rank < 0 || rank >= world)
      throw std::runtime_error(node + ": rank " + std::to_string(rank) + " of " + std::to_string(world) + " ranks");
  }

  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(node + ": " + what); }

  ~CollectiveKernel() {
    if (channel_ != nullptr) Channels::release(channel_id_);
  }
  CollectiveKernel(const CollectiveKernel&) = delete;
  CollectiveKernel& operator=(const CollectiveKernel&) = delete;

  // The channel of this step's tp_group (the engine's, the same every step).
  Channel& channel(Ort::KernelContext& ctx) {
    const Ort::ConstValue group = ctx.GetInput(1);
    if (group.GetTensorTypeAndShapeInfo().GetElementCount() != 1) fail("tp_group must hold one channel id");
    const int64_t id = group.GetTensorData<int64_t>()[0];
    if (channel_ == nullptr || id != channel_id_) {
      Channel* next = Channels::acquire(id, world);
      if (channel_ != nullptr) Channels::release(channel_id_);
      channel_id_ = id;
      channel_ = next;
    }
    return *channel_;
  }

  // One piece: this rank's `count` floats in, every rank's slot readable after the call.
  int64_t exchange(Channel& ch, const float* x, int64_t count) const {
    const int64_t buffer = ch.next_buffer();
    char* own = ch.slot(buffer, rank);
    const SlotHead head{node_tag, count};
    std::memcpy(own, &head, sizeof head);
    std::memcpy(own + kSlotHeader, x, count * sizeof(float));
    ch.barrier(node);
    for (int64_t r = 0; r < world; ++r) {
      SlotHead other;
      std::memcpy(&other, ch.slot(buffer, r), sizeof other);
      if (other.tag != node_tag || other.count != count)
        fail("rank " + std::to_string(r) + " reached another collective or size; the ranks' engines differ");
    }
    return buffer;
  }

  static const float* data(Channel& ch, int64_t buffer, int64_t r) {
    return reinterpret_cast<const float*>(ch.slot(buffer, r) + kSlotHeader);
  }
};

struct AllReduceKernel : CollectiveKernel {
  AllReduceKernel(const OrtApi&, const OrtKernelInfo* info) : CollectiveKernel(info) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0);
    const auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t n = static_cast<int64_t>(x.GetTensorTypeAndShapeInfo().GetElementCount());
    float* y = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    Channel& ch = channel(ctx);
    const float* in = x.GetTensorData<float>();
    for (int64_t start = 0; start < n; start += ch.slot_floats()) {
      const int64_t count = std::min(ch.slot_floats(), n - start);
      const int64_t buffer = exchange(ch, in + start, count);
      float* out = y + start;
      std::memcpy(out, data(ch, buffer, 0), count * sizeof(float));
      for (int64_t r = 1; r < world; ++r) {
        const float* other = data(ch, buffer, r);
        for (int64_t i = 0; i < count; ++i) out[i] += other[i];
      }
    }
  }
};

struct AllGatherKernel : CollectiveKernel {
  AllGatherKernel(const OrtApi&, const OrtKernelInfo* info) : CollectiveKernel(info) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue x = ctx.GetInput(0);
    const auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2) fail("AllGather takes [rows, columns]");
    const int64_t rows = shape[0], cols = shape[1];
    float* y = ctx.GetOutput(0, std::vector<int64_t>{rows, world * cols}).GetTensorMutableData<float>();
    Channel& ch = channel(ctx);
    if (cols > ch.slot_floats()) fail("a row of " + std::to_string(cols) + " values exceeds the channel's slots");
    const int64_t per_piece = ch.slot_floats() / std::max<int64_t>(cols, 1);
    const float* in = x.GetTensorData<float>();
    for (int64_t start = 0; start < rows; start += per_piece) {
      const int64_t count = std::min(per_piece, rows - start);
      const int64_t buffer = exchange(ch, in + start * cols, count * cols);
      for (int64_t r = 0; r < world; ++r) {
        const float* from = data(ch, buffer, r);
        for (int64_t i = 0; i < count; ++i)
          std::memcpy(y + (start + i) * world * cols + r * cols, from + i * cols, cols * sizeof(float));
      }
    }
  }
};

template <typename Kernel, const char* kName>
struct CollectiveOp : Ort::CustomOpBase<CollectiveOp<Kernel, kName>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return kName; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

constexpr char kAllReduce[] = "AllReduce";
constexpr char kAllGather[] = "AllGather";

}  // namespace

const OrtCustomOp* all_reduce_op() {
  static CollectiveOp<AllReduceKernel, kAllReduce> op;
  return &op;
}

const OrtCustomOp* all_gather_op() {
  static CollectiveOp<AllGatherKernel, kAllGather> op;
  return &op;
}

}  // namespace trtbuild_cpu_ops
