#include "operator_files.h"

#include "moe_reroute/error.h"
#include "output_set.h"

namespace moe_reroute::tools {

std::optional<std::string> given(const std::string& value) {
  return value.empty() ? std::nullopt : std::optional(value);
}

std::optional<LoadedTensor> load_optional(const std::string& path, std::string_view argument,
                                          const std::string& dtype_name,
                                          std::string_view dtype_flag) {
  if (path.empty()) return std::nullopt;
  return load_tensor(path, argument, given(dtype_name), dtype_flag);
}

void check_named_file(const std::string& path, const std::string& dtype_name,
                      std::string_view argument, std::string_view path_flag,
                      std::string_view dtype_flag) {
  if (path.empty() && !dtype_name.empty()) {
    throw Error(ErrorCode::kInvalidArgument, std::string(argument) + ": " +
                                                 std::string(dtype_flag) + " needs " +
                                                 std::string(path_flag));
  }
}

std::optional<TensorView> view_of(const std::optional<LoadedTensor>& loaded) {
  return loaded ? std::optional(loaded->view) : std::nullopt;
}

OutputBuffers::OutputBuffers(const std::vector<TensorSpec>& specs) {
  bytes.reserve(specs.size());
  for (const TensorSpec& spec : specs) {
    bytes.emplace_back(static_cast<std::size_t>(spec.nbytes()));
    views.emplace_back(bytes.back().data(), spec.dtype, spec.shape);
  }
}

void write_outputs(const std::string& dir, std::span<const OutputDesc> outputs,
                   const std::vector<TensorView>& views) {
  OutputSet out(dir);
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    out.add(std::string(outputs[i].name) + ".npy", views[i]);
  }
  out.commit();
}

}  // namespace moe_reroute::tools
