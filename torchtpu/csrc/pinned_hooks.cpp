// The tpu's PrivateUse1 hooks, in C++ because torch 2.13 takes three answers only from a C++
// PrivateUse1HooksInterface (its Python hooks class forwards is_available / has_primary_context /
// is_built only): the pinned host allocator (getPinnedMemoryAllocator), "is this pointer pinned"
// (isPinnedPtr), both needed by DDP's reducer (static_graph, find_unused_parameters) and
// pin_memory(), and generators: new ones (getNewGenerator: torch.Generator(device="tpu")) and the
// default one (getDefaultGenerator: torch.tpu.default_generators[0], the stream torch.manual_seed seeds).
// Everything else stays in Python (torchtpu/runtime/device.py); this file answers what the Python
// hooks answered (built, available, a primary context) plus those three.
//
// Pinned blocks are page-aligned host memory, page-locked with mlock while RLIMIT_MEMLOCK allows
// (XLA stages host->device copies itself, so locking only spares the kernel paging them out); a
// block mlock refuses stays an ordinary allocation. Either way it is this allocator's block, and
// isPinnedPtr answers true for any address inside a live block.
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/GeneratorImpl.h>
#include <torch/csrc/Generator.h>  // THPGenerator_initDefaultGenerator (libtorch_python, no pybind11)

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

struct Block {
  size_t bytes;
  bool locked;
};

std::mutex blocks_mutex;
std::map<uintptr_t, Block> blocks;  // start address -> block
int64_t live_bytes = 0;
int64_t locked_bytes = 0;
int64_t allocations = 0;  // cumulative

// RLIMIT_MEMLOCK's soft limit, honoured even where the process may exceed it (CAP_IPC_LOCK, root):
// page-locked memory is taken from everyone else on the host
uint64_t lock_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 0;
  return limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(limit.rlim_cur);
}

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

void free_block(void* ptr) {
  if (ptr == nullptr) return;
  Block block{};
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    auto it = blocks.find(reinterpret_cast<uintptr_t>(ptr));
    TORCH_INTERNAL_ASSERT(it != blocks.end(), "torchtpu pinned allocator: freeing an unknown block");
    block = it->second;
    blocks.erase(it);
    live_bytes -= static_cast<int64_t>(block.bytes);
    if (block.locked) locked_bytes -= static_cast<int64_t>(block.bytes);
  }
  if (block.locked) munlock(ptr, block.bytes);
  std::free(ptr);
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    // whole pages: mlock/munlock work on pages, so two blocks must never share one
    const size_t page = page_size();
    const size_t bytes = ((n == 0 ? 1 : n) + page - 1) / page * page;
    void* ptr = nullptr;
    if (posix_memalign(&ptr, page, bytes) != 0 || ptr == nullptr) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "torchtpu: cannot allocate ", n, " bytes of pinned host memory");
    }
    std::lock_guard<std::mutex> lock(blocks_mutex);
    // over the limit (or refused by mlock): the block stays ordinary memory, still this allocator's
    const bool locked = static_cast<uint64_t>(locked_bytes) + bytes <= lock_limit() && mlock(ptr, bytes) == 0;
    blocks.emplace(reinterpret_cast<uintptr_t>(ptr), Block{bytes, locked});
    live_bytes += static_cast<int64_t>(bytes);
    if (locked) locked_bytes += static_cast<int64_t>(bytes);
    ++allocations;
    return {ptr, ptr, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_block;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

bool is_pinned_address(const void* data) {
  const auto addr = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(blocks_mutex);
  auto it = blocks.upper_bound(addr);  // first block starting after addr
  if (it == blocks.begin()) return false;
  --it;
  return addr < it->first + it->second.bytes;
}

// A tpu generator is the state of one random stream: a seed and a counter (the offset), as the
// process's global tpu stream (torchtpu/base/rng.py) is. It draws nothing itself: each random op
// given generator=g derives its JAX key from (g.initial_seed(), g.get_offset()) and advances the
// offset by one, so a generator seeded like the global stream gives the same numbers.
// get_state() is 16 bytes (seed, offset: two little-endian uint64), a CPU ByteTensor as torch wants.
struct TPUGeneratorImpl final : public c10::GeneratorImpl {
  explicit TPUGeneratorImpl(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index < 0 ? 0 : index),
                           // no dispatch key: the tensors choose the kernel, so a CPU op given a tpu
                           // generator reaches CPU's kernel and its "Expected a 'cpu' device type" error
                           c10::DispatchKeySet()),
        seed_(seed) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;  // a new seed starts its stream from the beginning (torch.cuda's generators do too)
  }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    const uint64_t s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::detail::empty_cpu({kStateBytes}, c10::ScalarType::Byte, std::nullopt, std::nullopt,
                                       std::nullopt, std::nullopt);
    uint64_t words[2] = {seed_, offset_};
    std::memcpy(state.data_ptr(), words, kStateBytes);
    return state.getIntrusivePtr();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    at::detail::check_rng_state(new_state);
    TORCH_CHECK(new_state.numel() == kStateBytes, "RNG state is wrong size: a tpu generator's state is ",
                kStateBytes, " bytes (seed, offset), got ", new_state.numel());
    uint64_t words[2];
    std::memcpy(words, new_state.data(), kStateBytes);
    seed_ = words[0];
    offset_ = words[1];
  }

  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

 private:
  static constexpr int64_t kStateBytes = 16;
  TPUGeneratorImpl* clone_impl() const override {
    auto* g = new TPUGeneratorImpl(device().index(), seed_);
    g->offset_ = offset_;
    return g;
  }
  uint64_t seed_;
  uint64_t offset_ = 0;
};

struct TPUHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void* data) const override { return is_pinned_address(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    TORCH_CHECK(device_index <= 0, "torch.Generator: tpu has one device per process (tpu or tpu:0), got tpu:",
                static_cast<int>(device_index));
    return at::make_generator<TPUGeneratorImpl>(device_index);
  }
  // The process's global tpu stream (torchtpu/base/rng.py keeps its seed and offset here), as
  // at::cuda::detail::getDefaultCUDAGenerator is CUDA's: one per process, never freed.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    TORCH_CHECK(device_index <= 0, "the default tpu generator: tpu has one device per process (tpu or tpu:0), got tpu:",
                static_cast<int>(device_index));
    static const at::Generator default_generator = at::make_generator<TPUGeneratorImpl>(0);
    return default_generator;
  }
};

}  // namespace

// A C interface (loaded with ctypes): no pybind11 to compile, so the build takes seconds.
extern "C" {

// 1: these hooks are registered; 0: PrivateUse1 hooks were already registered (torch allows one).
int torchtpu_register_hooks() {
  if (at::isPrivateUse1HooksRegistered()) return 0;
  static TPUHooks hooks;  // lives as long as the process, as torch requires
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return 1;
}

// The default generator as a torch.Generator (a new Python object; runtime/pinned.py makes it once and
// keeps it), or nullptr with a Python error set. Called through ctypes.PyDLL, holding the GIL.
PyObject* torchtpu_default_generator() {
  try {
    return THPGenerator_initDefaultGenerator(
        at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::PrivateUse1, 0)));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// live blocks, live bytes, page-locked bytes, allocations so far
void torchtpu_pinned_stats(int64_t* out) {
  std::lock_guard<std::mutex> lock(blocks_mutex);
  out[0] = static_cast<int64_t>(blocks.size());
  out[1] = live_bytes;
  out[2] = locked_bytes;
  out[3] = allocations;
}

}  // extern "C"
