// The tpu's PrivateUse1 hooks, in C++ for one reason: torch 2.13 takes the pinned host allocator
// (getPinnedMemoryAllocator) and the "is this pointer pinned" answer (isPinnedPtr) only from a C++
// PrivateUse1HooksInterface; its Python hooks class forwards is_available / has_primary_context /
// is_built only. DDP's reducer (static_graph, find_unused_parameters) and pin_memory() need both.
// Everything else stays in Python (torchtpu/runtime/device.py); this file answers what the Python
// hooks answered (built, available, a primary context) plus the pinned allocator.
//
// Pinned blocks are page-aligned host memory, page-locked with mlock while RLIMIT_MEMLOCK allows
// (XLA stages host->device copies itself, so locking only spares the kernel paging them out); a
// block mlock refuses stays an ordinary allocation. Either way it is this allocator's block, and
// isPinnedPtr answers true for any address inside a live block.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>

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

struct TPUHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void* data) const override { return is_pinned_address(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
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

// live blocks, live bytes, page-locked bytes, allocations so far
void torchtpu_pinned_stats(int64_t* out) {
  std::lock_guard<std::mutex> lock(blocks_mutex);
  out[0] = static_cast<int64_t>(blocks.size());
  out[1] = live_bytes;
  out[2] = locked_bytes;
  out[3] = allocations;
}

}  // extern "C"
