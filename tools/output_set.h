#pragma once

// Writes a command's .npy outputs so that none appears under its final name
// until every one is complete: each goes to a hidden temporary name in the
// output directory, and all are renamed into place at the end.

#include <filesystem>
#include <string>
#include <vector>

#include "moe_reroute/tensor.h"

namespace moe_reroute::tools {

class OutputSet {
 public:
  /// Creates `dir` if missing; throws Error naming `out` when it cannot.
  explicit OutputSet(std::filesystem::path dir);
  /// Removes the temporaries of a set that was never committed.
  ~OutputSet();
  OutputSet(const OutputSet&) = delete;
  OutputSet& operator=(const OutputSet&) = delete;

  /// Writes `view` (in its .npy storage) to a temporary for `file_name`.
  void add(const std::string& file_name, const TensorView& view);
  /// Renames every temporary to its final name; throws Error naming `out`
  /// when one cannot be, after putting back every file it had replaced.
  void commit();

 private:
  struct File {
    std::filesystem::path temp, final_path, old;  // old: where the replaced file waits
    bool moved_aside = false, placed = false;
  };
  void place(File& file);

  std::filesystem::path dir_;
  std::vector<File> files_;
};

}  // namespace moe_reroute::tools
