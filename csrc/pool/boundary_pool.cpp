#include "boundary_pool.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdlib>
#include <unordered_map>

namespace ckpt_ext {
namespace {

constexpr size_t kMiB = size_t(1) << 20;

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

size_t default_chunk_bytes(c10::Device device) {
  if (const char* env = std::getenv("CKPT_EXT_POOL_CHUNK_MB")) {
    long mb = std::strtol(env, nullptr, 10);
    TORCH_CHECK(mb > 0, "CKPT_EXT_POOL_CHUNK_MB must be a positive number of MiB, got '", env, "'");
    return size_t(mb) * kMiB;
  }
  // Large on accelerators (boundaries of big models are MiBs each), modest on CPU.
  return device.is_cpu() ? 4 * kMiB : 64 * kMiB;
}

struct DeviceHash {
  size_t operator()(const c10::Device& d) const noexcept {
    return std::hash<int>()(static_cast<int>(d.type()) * 4096 + d.index());
  }
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
// Leaked on purpose: slots may be released during interpreter shutdown, after static destructors.
std::unordered_map<c10::Device, std::shared_ptr<BoundaryPool>, DeviceHash>& registry() {
  static auto* r = new std::unordered_map<c10::Device, std::shared_ptr<BoundaryPool>, DeviceHash>();
  return *r;
}

}  // namespace

struct BoundaryPool::Slot {
  std::shared_ptr<BoundaryPool> pool;  // keeps the pool alive while any slot is
  Chunk* chunk;
  size_t offset;
  size_t bytes;
  std::optional<c10::Stream> alloc_stream;
  c10::SmallVector<c10::Stream, 1> used_on;  // other streams that used this slot
};

std::shared_ptr<BoundaryPool> BoundaryPool::for_device(c10::Device device) {
  if (device.type() != c10::DeviceType::CPU && !device.has_index()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    device = c10::Device(device.type(), impl.getDevice().index());
  }
  if (device.is_cpu()) device = c10::Device(c10::DeviceType::CPU);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& slot = registry()[device];
  if (!slot) slot = std::make_shared<BoundaryPool>(device);
  return slot;
}

std::vector<std::shared_ptr<BoundaryPool>> BoundaryPool::all() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::shared_ptr<BoundaryPool>> out;
  for (auto& kv : registry()) out.push_back(kv.second);
  return out;
}

BoundaryPool::BoundaryPool(c10::Device device) : device_(device), chunk_bytes_(default_chunk_bytes(device)) {}

std::optional<c10::Stream> BoundaryPool::current_stream() const {
  if (device_.is_cpu()) return std::nullopt;
  c10::impl::VirtualGuardImpl impl(device_.type());
  return impl.getStream(device_);
}

void BoundaryPool::order_after_arena_stream(const std::optional<c10::Stream>& stream) {
  // Freed memory was handed back in the arena stream's order; work on another stream may only reuse
  // it once that stream has waited for everything queued on the arena stream so far.
  if (!stream) return;
  if (arena_stream_ && *arena_stream_ != *stream) {
    c10::Event ev(device_.type());
    ev.record(*arena_stream_);
    ev.block(*stream);
    stats_.stream_fences++;
  }
  arena_stream_ = stream;
}

bool BoundaryPool::take_from_top(Chunk& c, size_t bytes, size_t* offset) {
  if (c.capacity - c.top < bytes) return false;
  *offset = c.top;
  c.top += bytes;
  return true;
}

bool BoundaryPool::take_from_holes(Chunk& c, size_t bytes, size_t* offset) {
  for (auto it = c.holes.begin(); it != c.holes.end(); ++it) {
    if (it->second < bytes) continue;
    *offset = it->first;
    size_t rest = it->second - bytes;
    c.holes.erase(it);
    if (rest) c.holes.emplace(*offset + bytes, rest);
    return true;
  }
  return false;
}

void BoundaryPool::give_back(Chunk& c, size_t offset, size_t bytes) {
  if (offset + bytes == c.top) {  // LIFO fast path
    c.top = offset;
    // The top came down to a hole: swallow it (and so on down).
    while (!c.holes.empty()) {
      auto last = std::prev(c.holes.end());
      if (last->first + last->second != c.top) break;
      c.top = last->first;
      c.holes.erase(last);
    }
    return;
  }
  auto next = c.holes.lower_bound(offset);
  if (next != c.holes.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = c.holes.erase(next);
  }
  if (next != c.holes.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  c.holes.emplace(offset, bytes);
}

std::pair<BoundaryPool::Chunk*, size_t> BoundaryPool::reserve(size_t bytes) {
  size_t offset = 0;
  if (active_ && take_from_top(*active_, bytes, &offset)) return {active_, offset};
  for (auto& c : chunks_) {
    if (take_from_top(*c, bytes, &offset) || take_from_holes(*c, bytes, &offset)) {
      active_ = c.get();
      return {active_, offset};
    }
  }
  active_ = grow(bytes);
  take_from_top(*active_, bytes, &offset);
  return {active_, offset};
}

BoundaryPool::Chunk* BoundaryPool::grow(size_t bytes) {
  // A large request gets a chunk of its own size; smaller ones share a chunk holding a whole number
  // of them (why: the header's file comment).
  bool shared = bytes <= chunk_bytes_ / 4;
  size_t capacity = shared ? chunk_bytes_ / bytes * bytes : bytes;
  auto chunk = std::make_unique<Chunk>();
  auto options = at::TensorOptions().dtype(at::kByte).device(device_);
  // CUDA's caching allocator returns 512-byte aligned blocks, so ask it for exactly the capacity (a
  // padded request would turn a 64 MiB chunk into a 66 MiB segment); elsewhere pad for the alignment.
  size_t pad = device_.is_cuda() ? 0 : kAlignment;
  chunk->buffer = at::empty({static_cast<int64_t>(capacity + pad)}, options);
  auto raw = reinterpret_cast<uintptr_t>(chunk->buffer.data_ptr());
  if (align_up(raw, kAlignment) - raw > pad) {  // an allocator that does not align: pad after all
    chunk->buffer = at::empty({static_cast<int64_t>(capacity + kAlignment)}, options);
    raw = reinterpret_cast<uintptr_t>(chunk->buffer.data_ptr());
  }
  chunk->base = reinterpret_cast<uint8_t*>(align_up(raw, kAlignment));
  chunk->capacity = capacity;
  chunk->shared = shared;
  chunk->alloc_stream = current_stream();
  stats_.grows++;
  stats_.reserved_bytes += static_cast<int64_t>(capacity);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  chunks_.push_back(std::move(chunk));
  return chunks_.back().get();
}

at::Tensor BoundaryPool::drop_chunk(Chunk* chunk) {
  auto it = std::find_if(chunks_.begin(), chunks_.end(), [&](const auto& c) { return c.get() == chunk; });
  TORCH_INTERNAL_ASSERT(it != chunks_.end() && chunk->live == 0);
  // PyTorch's allocator reuses the buffer in the order of the stream it was allocated on; make it wait
  // for the arena stream, where the slots were last handed out and where release() fenced every
  // stream that used them.
  if (arena_stream_ && chunk->alloc_stream && *arena_stream_ != *chunk->alloc_stream)
    chunk->buffer.record_stream(*arena_stream_);
  at::Tensor buffer = std::move(chunk->buffer);
  stats_.reserved_bytes -= static_cast<int64_t>(chunk->capacity);
  stats_.releases++;
  if (active_ == chunk) active_ = nullptr;
  if (spare_ == chunk) spare_ = nullptr;
  chunks_.erase(it);
  return buffer;
}

at::Tensor BoundaryPool::empty(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  TORCH_CHECK(sizes.size() == strides.size(), "BoundaryPool::empty: sizes and strides differ in length");
  int64_t span = 1;  // elements covered by the strided view
  bool zero = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) zero = true;
    span += (sizes[i] - 1) * strides[i];
  }
  auto options = at::TensorOptions().dtype(dtype).device(device_);
  if (zero) return at::empty_strided(sizes, strides, options);
  size_t bytes = align_up(static_cast<size_t>(span) * c10::elementSize(dtype), kAlignment);

  auto stream = current_stream();
  auto slot = std::make_unique<Slot>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    order_after_arena_stream(stream);
    auto [chunk, offset] = reserve(bytes);
    if (chunk == spare_) spare_ = nullptr;  // in use again
    chunk->live++;
    slot->chunk = chunk;
    slot->offset = offset;
    slot->bytes = bytes;
    slot->alloc_stream = stream;
    stats_.in_use_bytes += static_cast<int64_t>(bytes);
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
    stats_.live_slots++;
    stats_.allocations++;
  }
  slot->pool = shared_from_this();
  void* data = slot->chunk->base + slot->offset;
  return at::for_blob(data, sizes)
      .strides(strides)
      .context(slot.release(), &BoundaryPool::delete_slot)
      .options(options)
      .target_device(device_)
      .make_tensor();
}

at::Tensor BoundaryPool::store(const at::Tensor& src) {
  TORCH_CHECK(src.device() == device_ || (device_.is_cpu() && src.device().is_cpu()),
              "BoundaryPool for ", device_, " cannot store a tensor on ", src.device());
  // Keep the source's strides when it is dense (a transposed output stays transposed); otherwise
  // store it contiguously.
  at::Tensor dst = src.is_non_overlapping_and_dense()
                       ? empty(src.sizes(), src.strides(), src.scalar_type())
                       : empty(src.sizes(), c10::contiguous_strides(src.sizes()), src.scalar_type());
  if (src.numel() > 0) dst.copy_(src);
  return dst;
}

void BoundaryPool::delete_slot(void* ctx) {
  auto* slot = static_cast<Slot*>(ctx);
  std::shared_ptr<BoundaryPool> pool = std::move(slot->pool);
  at::Tensor dropped = pool->release(slot);  // a released chunk's buffer, freed here, outside the lock
  delete slot;
}

at::Tensor BoundaryPool::release(Slot* slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!device_.is_cpu()) {
    // Work on other streams may still read this slot: make the arena stream wait for it.
    c10::SmallVector<c10::Stream, 2> streams(slot->used_on.begin(), slot->used_on.end());
    if (slot->alloc_stream) streams.push_back(*slot->alloc_stream);
    for (const auto& s : streams) {
      if (arena_stream_ && s != *arena_stream_) {
        c10::Event ev(device_.type());
        ev.record(s);
        ev.block(*arena_stream_);
        stats_.stream_fences++;
      }
    }
  }
  Chunk* chunk = slot->chunk;
  give_back(*chunk, slot->offset, slot->bytes);
  chunk->live--;
  stats_.in_use_bytes -= static_cast<int64_t>(slot->bytes);
  stats_.live_slots--;
  if (chunk->live != 0) return {};
  // The chunk is empty: it goes back to PyTorch's allocator at once unless it becomes the spare. Of two
  // empty shared chunks the larger is kept, so the spare's size only grows: a training loop settles on
  // a fixed reservation even when its shapes vary.
  if (!chunk->shared) return drop_chunk(chunk);  // one spare at most: spare_
  if (!spare_) {
    spare_ = chunk;
    return {};
  }
  if (spare_->capacity > chunk->capacity) return drop_chunk(chunk);
  at::Tensor dropped = drop_chunk(spare_);
  spare_ = chunk;
  return dropped;
}

bool BoundaryPool::owns(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  return t.storage().data_ptr().get_deleter() == &BoundaryPool::delete_slot;
}

void BoundaryPool::record_stream(const at::Tensor& t, c10::Stream stream) {
  if (!owns(t)) return;
  auto* slot = static_cast<Slot*>(t.storage().data_ptr().get_context());
  std::lock_guard<std::mutex> lock(slot->pool->mutex_);
  if (slot->alloc_stream && *slot->alloc_stream == stream) return;
  for (const auto& s : slot->used_on)
    if (s == stream) return;
  slot->used_on.push_back(stream);
}

PoolStats BoundaryPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PoolStats s = stats_;
  s.chunks = static_cast<int64_t>(chunks_.size());
  return s;
}

void BoundaryPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

int64_t BoundaryPool::release_unused() {
  std::vector<at::Tensor> dropped;  // destroyed after the lock is released
  int64_t released = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Chunk*> empty;
    for (auto& c : chunks_)
      if (c->live == 0) empty.push_back(c.get());
    for (Chunk* c : empty) {
      released += static_cast<int64_t>(c->capacity);
      dropped.push_back(drop_chunk(c));
    }
  }
  return released;
}

void BoundaryPool::set_chunk_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= kMinChunkBytes, "pool chunk size must be at least ", kMinChunkBytes, " bytes, got ", bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  chunk_bytes_ = align_up(static_cast<size_t>(bytes), kAlignment);
}

int64_t BoundaryPool::chunk_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(chunk_bytes_);
}

}  // namespace ckpt_ext
