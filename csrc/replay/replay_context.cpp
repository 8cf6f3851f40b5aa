#include "replay_context.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <mutex>

namespace ckpt_ext {
namespace {

thread_local int recompute_depth = 0;

bool has_philox_state(c10::DeviceType t) { return t == c10::DeviceType::CUDA; }

c10::Device current_device_of(c10::DeviceType type) {
  c10::impl::VirtualGuardImpl impl(type);
  return impl.getDevice();
}

void set_current_device(const c10::Device& d) {
  c10::impl::VirtualGuardImpl impl(d.type());
  impl.setDevice(d);
}

}  // namespace

bool is_recomputing() { return recompute_depth > 0; }

RecomputingScope::RecomputingScope() { ++recompute_depth; }
RecomputingScope::~RecomputingScope() { --recompute_depth; }

RngSnapshot RngSnapshot::capture(const std::vector<c10::Device>& devices) {
  RngSnapshot s;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    s.cpu = CpuRng{impl->engine(), impl->next_float_normal_sample(), impl->next_double_normal_sample()};
  }
  for (const auto& d : devices) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    DeviceRng r{d};
    if (has_philox_state(d.type())) {
      r.seed = gen.current_seed();
      r.offset = gen.get_offset();
    } else {
      r.state = gen.get_state();
    }
    s.devices.push_back(std::move(r));
  }
  return s;
}

void RngSnapshot::restore() const {
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    impl->set_engine(cpu->engine);
    impl->set_next_float_normal_sample(cpu->next_float_normal);
    impl->set_next_double_normal_sample(cpu->next_double_normal);
  }
  for (const auto& r : devices) {
    auto gen = at::globalContext().defaultGenerator(r.device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    if (r.state.defined()) {
      gen.set_state(r.state);
    } else {
      gen.set_current_seed(r.seed);  // also resets the offset
      gen.set_offset(r.offset);
    }
  }
}

AutocastSnapshot AutocastSnapshot::capture(const std::vector<c10::Device>& devices) {
  AutocastSnapshot s;
  auto add = [&](c10::DeviceType t) {
    for (const auto& e : s.entries)
      if (e.type == t) return;
    s.entries.push_back({t, at::autocast::is_autocast_enabled(t), at::autocast::get_autocast_dtype(t)});
  };
  add(c10::DeviceType::CPU);
  for (const auto& d : devices) add(d.type());
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return s;
}

void AutocastSnapshot::apply() const {
  for (const auto& e : entries) {
    at::autocast::set_autocast_enabled(e.type, e.enabled);
    at::autocast::set_autocast_dtype(e.type, e.dtype);
  }
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

ExecutionSnapshot ExecutionSnapshot::capture(const std::vector<c10::Device>& tensor_devices, bool preserve_rng) {
  ExecutionSnapshot s;
  for (const auto& d : tensor_devices) {
    if (d.is_cpu()) continue;
    bool seen = false;
    for (const auto& e : s.devices) seen = seen || e == d;
    if (!seen) s.devices.push_back(d);
  }
  for (const auto& d : s.devices) {
    bool type_done = false;
    for (const auto& c : s.current) type_done = type_done || c.type() == d.type();
    if (!type_done) s.current.push_back(current_device_of(d.type()));
  }
  if (preserve_rng) s.rng = RngSnapshot::capture(s.devices);
  s.autocast = AutocastSnapshot::capture(s.devices);
  return s;
}

ReplayGuard::ReplayGuard(const ExecutionSnapshot& snap) {
  for (const auto& d : snap.current) saved_current_.push_back(current_device_of(d.type()));
  if (snap.rng) {
    // Fork: the replay draws the forward's random numbers, then the generators continue as before.
    saved_rng_ = RngSnapshot::capture(snap.devices);
    snap.rng->restore();
  }
  saved_autocast_ = AutocastSnapshot::capture(snap.devices);
  snap.autocast.apply();
  // Autocast's weight-cast cache is cleared when the outermost autocast region exits; the replay is
  // such a region.
  at::autocast::increment_nesting();
  for (const auto& d : snap.current) set_current_device(d);
  ++recompute_depth;
}

ReplayGuard::~ReplayGuard() {
  --recompute_depth;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  saved_autocast_.apply();
  if (saved_rng_) saved_rng_->restore();
  for (const auto& d : saved_current_) set_current_device(d);
}

}  // namespace ckpt_ext
