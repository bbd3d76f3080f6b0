#pragma once

// The values of an int32 or int64 .npy array, for the CLI tests' checks.

#include <cstdint>
#include <cstring>
#include <vector>

#include "npy.h"

namespace moe_reroute::tools {

inline std::vector<std::int64_t> int_values(const NpyArray& array) {
  std::vector<std::int64_t> values;
  const std::size_t itemsize = array.descr == "<i8" ? 8 : 4;
  for (std::size_t i = 0; i < array.data.size(); i += itemsize) {
    std::int64_t value = 0;
    if (itemsize == 8) {
      std::memcpy(&value, array.data.data() + i, 8);
    } else {
      std::int32_t value32 = 0;
      std::memcpy(&value32, array.data.data() + i, 4);
      value = value32;
    }
    values.push_back(value);
  }
  return values;
}

}  // namespace moe_reroute::tools
