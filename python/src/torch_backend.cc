// The registered backends of the torch kernels, by device type.

#include "torch_backend.h"

#include <array>
#include <atomic>
#include <cstddef>
#include <optional>
#include <string>

namespace moe_reroute::torch_ops {
namespace {

constexpr auto kNumDeviceTypes = static_cast<std::size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

// A function-local static: backends register from other files' initializers.
std::array<std::optional<Backend>, kNumDeviceTypes>& backends() {
  static std::array<std::optional<Backend>, kNumDeviceTypes> table;
  return table;
}

std::atomic<bool> sync_mode{false};

}  // namespace

bool register_backend(c10::DeviceType type, const Backend& backend) {
  backends()[static_cast<std::size_t>(type)] = backend;
  return true;
}

const Backend* backend_of(c10::DeviceType type) {
  const std::optional<Backend>& backend = backends()[static_cast<std::size_t>(type)];
  return backend ? &*backend : nullptr;
}

void check_backends() {
  for (const std::optional<Backend>& backend : backends()) {
    if (backend && backend->check) backend->check();
  }
}

bool sync_checks() { return sync_mode.load(std::memory_order_relaxed); }

bool set_sync_checks(bool sync) { return sync_mode.exchange(sync); }

std::string other_devices() {
  std::string devices;
  for (std::size_t i = 0; i < kNumDeviceTypes; ++i) {
    const auto type = static_cast<c10::DeviceType>(i);
    if (type != c10::DeviceType::CPU && backends()[i]) {
      devices += " or on a " + c10::DeviceTypeName(type) + " device";
    }
  }
  return devices.empty() ? " (this build has only the CPU backend)" : devices;
}

}  // namespace moe_reroute::torch_ops
