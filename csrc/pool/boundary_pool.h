// BoundaryPool: one arena per device that holds the tensors living from forward to backward
// (segment boundaries), packed into a few large chunks instead of scattered allocations.
//
// * Chunks come from PyTorch's allocator (at::empty), so the framework's memory statistics and
//   stream semantics stay right; slots inside them are 256-byte aligned.
// * Training frees in LIFO order (forward pushes, backward pops): a free at the top of a chunk
//   lowers its bump pointer, which is the fast path. Out-of-order frees leave a hole that is
//   coalesced with its neighbours and reused first-fit, and swallowed when the top comes down to it.
// * Memory goes back as backward frees it: a chunk whose last slot is freed returns to PyTorch's
//   allocator at once, where weight gradients can use it, except for one spare chunk kept so that a
//   training loop does not allocate a chunk anew at every step (the largest empty one: its size only
//   grows, so the loop reaches a steady state). Only a shared chunk is kept as the spare; a chunk
//   sized for one large slot always goes back (on CUDA the caching allocator keeps it for reuse).
// * Chunk sizing: a request larger than a quarter of the chunk size gets a chunk of exactly its size
//   (packing two or three large slots saves nothing and would hold all of them until the last is
//   freed); smaller requests share chunks sized to a whole number of such slots (no unusable tail
//   when boundaries are alike, the usual case).
// * A slot lives exactly as long as a tensor uses it: slot tensors own a storage whose deleter
//   returns the slot, so there is no use-after-free and nothing grows in steady state.
// * Streams (CUDA and other stream devices): memory is handed out in the order of one "arena
//   stream". A slot that was used on another stream (record_stream) is fenced at free time: an
//   event recorded on that stream is waited on by the arena stream. Allocating on a new stream
//   first makes that stream wait for the arena stream. Freed memory is thus reused in stream order.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace ckpt_ext {

struct PoolStats {
  int64_t reserved_bytes = 0;     // bytes held in chunks (taken from PyTorch's allocator)
  int64_t peak_reserved_bytes = 0;  // high-water mark of reserved_bytes since the last reset
  int64_t in_use_bytes = 0;       // bytes covered by live slots (aligned sizes)
  int64_t peak_in_use_bytes = 0;  // high-water mark of in_use_bytes since the last reset
  int64_t live_slots = 0;         // slots currently owned by a tensor
  int64_t grows = 0;              // chunks ever added
  int64_t releases = 0;           // chunks ever returned to PyTorch's allocator
  int64_t chunks = 0;             // chunks held now
  int64_t allocations = 0;        // slots ever handed out
  int64_t stream_fences = 0;      // cross-stream waits inserted to keep reuse in stream order
};

class BoundaryPool : public std::enable_shared_from_this<BoundaryPool> {
 public:
  static constexpr size_t kAlignment = 256;
  // The smallest chunk size set_chunk_bytes accepts (one aligned slot); Python reads it from here.
  static constexpr int64_t kMinChunkBytes = kAlignment;

  // The pool of a device; created on first use and kept for the life of the process.
  static std::shared_ptr<BoundaryPool> for_device(c10::Device device);
  // All pools created so far (for stats across devices).
  static std::vector<std::shared_ptr<BoundaryPool>> all();

  explicit BoundaryPool(c10::Device device);
  BoundaryPool(const BoundaryPool&) = delete;
  BoundaryPool& operator=(const BoundaryPool&) = delete;

  // A tensor with src's sizes, dtype and (when dense) strides, whose storage is a pool slot,
  // holding a copy of src. src must be on this pool's device.
  at::Tensor store(const at::Tensor& src);
  // An uninitialised tensor in a pool slot.
  at::Tensor empty(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype);

  // True when t's storage is a slot of some BoundaryPool.
  static bool owns(const at::Tensor& t);
  // Notes that a pooled tensor is used on `stream`, so that its slot is reused only after the work
  // queued there so far. No effect for tensors that are not pooled.
  static void record_stream(const at::Tensor& t, c10::Stream stream);

  PoolStats stats() const;
  void reset_peak();
  // Returns chunks without live slots (the spare) to PyTorch's allocator; returns the bytes released.
  int64_t release_unused();
  // Size of the chunks the arena grows by (a single larger request gets a chunk of its own size).
  void set_chunk_bytes(int64_t bytes);
  int64_t chunk_bytes() const;

  c10::Device device() const { return device_; }

 private:
  struct Chunk {
    at::Tensor buffer;   // owns the memory
    uint8_t* base;       // 256-aligned start inside buffer
    size_t capacity;     // usable bytes from base
    size_t top = 0;      // bump pointer: everything at or above is free
    std::map<size_t, size_t> holes;  // offset -> length of free ranges below top (coalesced)
    int64_t live = 0;    // live slots in this chunk
    bool shared = true;  // false: sized for one large slot, never kept as the spare
    std::optional<c10::Stream> alloc_stream;  // stream the buffer was allocated on
  };
  struct Slot;

  static void delete_slot(void* ctx);
  at::Tensor release(Slot* slot);
  // Finds room for `bytes` (already aligned), growing the arena if needed. Called with mutex_ held.
  std::pair<Chunk*, size_t> reserve(size_t bytes);
  static bool take_from_top(Chunk& c, size_t bytes, size_t* offset);
  static bool take_from_holes(Chunk& c, size_t bytes, size_t* offset);
  static void give_back(Chunk& c, size_t offset, size_t bytes);
  // Grows the arena by a chunk for a request of `bytes`. Called with mutex_ held.
  Chunk* grow(size_t bytes);
  // Removes an empty chunk; returns its buffer, to be dropped after mutex_ is released (PyTorch's
  // allocator takes its own lock). Called with mutex_ held.
  at::Tensor drop_chunk(Chunk* chunk);
  std::optional<c10::Stream> current_stream() const;
  void order_after_arena_stream(const std::optional<c10::Stream>& stream);

  const c10::Device device_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  Chunk* active_ = nullptr;  // chunk that took the last allocation: the LIFO fast path
  Chunk* spare_ = nullptr;   // the one empty chunk kept for reuse, if any
  size_t chunk_bytes_;
  std::optional<c10::Stream> arena_stream_;
  PoolStats stats_;
};

}  // namespace ckpt_ext
