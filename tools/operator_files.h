#pragma once

// What the operator subcommands (run, inverse, init-routing, finalize-routing)
// share: optional .npy inputs, output buffers of the inferred specs, and the
// outputs of an operator's description written all at once.

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe_reroute/operator.h"
#include "npy.h"

namespace moe_reroute::tools {

/// `value`, or nullopt when it is empty (an absent path or dtype name).
std::optional<std::string> given(const std::string& value);

/// The optional input `argument` read from `path` as load_tensor does, its
/// dtype named by `dtype_name` ("": by its storage) under `dtype_flag`;
/// nullopt when `path` is empty.
std::optional<LoadedTensor> load_optional(const std::string& path, std::string_view argument,
                                          const std::string& dtype_name,
                                          std::string_view dtype_flag);

/// Throws Error naming `argument` when `dtype_flag` names the dtype of a file
/// that `path_flag` did not give.
void check_named_file(const std::string& path, const std::string& dtype_name,
                      std::string_view argument, std::string_view path_flag,
                      std::string_view dtype_flag);

/// The view of an optional input.
std::optional<TensorView> view_of(const std::optional<LoadedTensor>& loaded);

/// Output buffers for `specs`, in their order.
struct OutputBuffers {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;

  explicit OutputBuffers(const std::vector<TensorSpec>& specs);
};

/// Writes `views[i]` as `<outputs[i].name>.npy` in `dir`, all or none (OutputSet).
void write_outputs(const std::string& dir, std::span<const OutputDesc> outputs,
                   const std::vector<TensorView>& views);

}  // namespace moe_reroute::tools
