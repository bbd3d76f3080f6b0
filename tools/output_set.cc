#include "output_set.h"

#include <unistd.h>

#include <system_error>
#include <utility>

#include "moe_reroute/error.h"
#include "npy.h"

namespace moe_reroute::tools {
namespace {

// A hidden name beside `file_name`, unique to this process.
std::filesystem::path hidden(const std::filesystem::path& dir, const std::string& file_name,
                             const char* suffix) {
  return dir / ("." + file_name + suffix + std::to_string(::getpid()));
}

void rename_or_throw(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::error_code error;
  std::filesystem::rename(from, to, error);
  if (error) {
    throw Error(ErrorCode::kInvalidArgument, "out: cannot rename " + from.string() + " to " +
                                                 to.string() + ": " + error.message());
  }
}

}  // namespace

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
  for (const File& file : files_) std::filesystem::remove(file.temp, ignored);
}

void OutputSet::add(const std::string& file_name, const TensorView& view) {
  files_.push_back({hidden(dir_, file_name, ".tmp"), dir_ / file_name,
                    hidden(dir_, file_name, ".old")});
  write_npy(files_.back().temp, storage_descr(view.dtype()), storage_shape(view.spec), view.data,
            static_cast<std::size_t>(view.nbytes()), "out");
}

void OutputSet::place(File& file) {
  // A directory is left where it is (the rename onto it fails): moved aside,
  // it could not be removed after a successful commit.
  std::error_code ignored;
  const std::filesystem::file_status status =
      std::filesystem::symlink_status(file.final_path, ignored);
  if (std::filesystem::exists(status) && !std::filesystem::is_directory(status)) {
    rename_or_throw(file.final_path, file.old);
    file.moved_aside = true;
  }
  rename_or_throw(file.temp, file.final_path);
  file.placed = true;
}

void OutputSet::commit() {
  // Each replaced file waits under a hidden name until all are placed, so a
  // failed rename can restore every output of the earlier run (all or none).
  std::error_code ignored;
  try {
    for (File& file : files_) place(file);
  } catch (const Error&) {
    for (const File& file : files_) {
      if (file.moved_aside) {
        std::filesystem::rename(file.old, file.final_path, ignored);
      } else if (file.placed) {
        std::filesystem::remove(file.final_path, ignored);
      }
    }
    throw;
  }
  for (const File& file : files_) {
    if (file.moved_aside) std::filesystem::remove(file.old, ignored);
  }
  files_.clear();
}

}  // namespace moe_reroute::tools
