#include "output_set.h"

#include <unistd.h>

#include <system_error>

#include "moe_reroute/error.h"
#include "npy.h"

namespace moe_reroute::tools {

OutputSet::OutputSet(std::filesystem::path dir) : dir_(std::move(dir)) {
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  if (error || !std::filesystem::is_directory(dir_)) {
    throw Error(ErrorCode::kInvalidArgument,
                "out: cannot create the directory " + dir_.string() +
                    (error ? ": " + error.message() : ": a file of that name exists"));
  }
}

OutputSet::~OutputSet() {
  std::error_code ignored;
  for (const auto& [temp, final_path] : files_) std::filesystem::remove(temp, ignored);
}

void OutputSet::add(const std::string& file_name, const TensorView& view) {
  const std::filesystem::path final_path = dir_ / file_name;
  const std::filesystem::path temp = dir_ / ("." + file_name + ".tmp" + std::to_string(::getpid()));
  files_.emplace_back(temp, final_path);
  write_npy(temp, storage_descr(view.dtype()), storage_shape(view.spec), view.data,
            static_cast<std::size_t>(view.nbytes()), "out");
}

void OutputSet::commit() {
  for (const auto& [temp, final_path] : files_) {
    std::error_code error;
    std::filesystem::rename(temp, final_path, error);
    if (error) {
      throw Error(ErrorCode::kInvalidArgument, "out: cannot rename " + temp.string() + " to " +
                                                   final_path.string() + ": " + error.message());
    }
  }
  files_.clear();
}

}  // namespace moe_reroute::tools
