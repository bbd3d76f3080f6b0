#pragma once

// A fresh directory under the system temp dir, removed with everything in it.

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

namespace moe_reroute::tools {

class TestDir {
 public:
  TestDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "moe-reroute-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    path_ = pattern;
  }
  ~TestDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TestDir(const TestDir&) = delete;
  TestDir& operator=(const TestDir&) = delete;

  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// Every name in `dir`, hidden ones included; empty when `dir` does not exist.
inline std::set<std::string> listing(const std::filesystem::path& dir) {
  std::set<std::string> names;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

}  // namespace moe_reroute::tools
