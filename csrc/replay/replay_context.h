// What a replay during backward must restore to run the user's function exactly as in forward:
// the RNG streams (CPU and each device's), the autocast state and the current device. Captured once
// per checkpointed call in forward; applied (and undone afterwards) around the replay.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

namespace ckpt_ext {

// RNG state of the CPU generator and of each device generator that the call may draw from.
// Device generators with a Philox (seed, offset) state (CUDA) are captured as those two numbers,
// not cloned; others fall back to their full state.
struct RngSnapshot {
  struct DeviceRng {
    c10::Device device;
    uint64_t seed = 0;
    uint64_t offset = 0;
    at::Tensor state;  // only for generators without a (seed, offset) state
  };
  // The CPU generator's state copied as values (no state tensor is built: this runs once per call).
  struct CpuRng {
    at::mt19937 engine;
    std::optional<float> next_float_normal;
    std::optional<double> next_double_normal;
  };
  std::optional<CpuRng> cpu;
  std::vector<DeviceRng> devices;

  static RngSnapshot capture(const std::vector<c10::Device>& devices);
  void restore() const;
};

// Autocast state for CPU and the devices of the call: enabled and dtype per device type, plus the
// weight-cast cache flag.
struct AutocastSnapshot {
  struct Entry {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Entry> entries;
  bool cache_enabled = true;

  static AutocastSnapshot capture(const std::vector<c10::Device>& devices);
  void apply() const;
};

// The execution context of one checkpointed call in forward.
struct ExecutionSnapshot {
  std::vector<c10::Device> devices;  // non-CPU devices of the call's tensors (their RNGs are restored)
  std::vector<c10::Device> current;  // the current device of each of those device types in forward
  std::optional<RngSnapshot> rng;    // absent when preserve_rng_state=False
  AutocastSnapshot autocast;

  static ExecutionSnapshot capture(const std::vector<c10::Device>& tensor_devices, bool preserve_rng);
};

// Applies a snapshot for the lifetime of the guard (replay), restoring what was there before on
// exit, exceptions included. Also marks the thread as recomputing.
class ReplayGuard {
 public:
  explicit ReplayGuard(const ExecutionSnapshot& snap);
  ~ReplayGuard();
  ReplayGuard(const ReplayGuard&) = delete;
  ReplayGuard& operator=(const ReplayGuard&) = delete;

 private:
  std::optional<RngSnapshot> saved_rng_;
  AutocastSnapshot saved_autocast_;
  std::vector<c10::Device> saved_current_;
};

// True while this thread runs a replay (ckpt_ext.is_recomputing()).
bool is_recomputing();

// Marks the thread as recomputing for its lifetime, without touching RNG/autocast state: for replays
// that need no snapshot (the fused SegmentFunction draws its dropout from stored seeds).
class RecomputingScope {
 public:
  RecomputingScope();
  ~RecomputingScope();
  RecomputingScope(const RecomputingScope&) = delete;
  RecomputingScope& operator=(const RecomputingScope&) = delete;
};

}  // namespace ckpt_ext
