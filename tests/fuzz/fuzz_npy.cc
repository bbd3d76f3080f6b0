// Fuzzes the CLI's .npy reader: the input's first byte picks the dtype name
// passed with the file (none, a table name, an unknown name), the rest is the
// file. Every refusal must be a moe_reroute::Error; an accepted file must
// give a view describing exactly the bytes read, and write back to a file
// that reads the same.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_arguments.h"
#include "npy.h"

namespace moe_reroute::fuzz {
namespace {

// An in-memory file, reached by path as the reader needs.
class MemoryFile {
 public:
  MemoryFile() : fd_(memfd_create("fuzz_npy", 0)) {
    require(fd_ >= 0, "memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  const std::string& write(const void* data, std::size_t size) {
    require(ftruncate(fd_, 0) == 0 && pwrite(fd_, data, size, 0) == static_cast<ssize_t>(size),
            "cannot write the memory file");
    return path_;
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

std::optional<std::string> dtype_name(std::uint8_t pick) {
  const auto table = dtype_table();
  if (pick < 128) return std::nullopt;
  if (pick == 255) return std::string("float7_unknown");
  return std::string(table[(pick - 128u) % table.size()].name);
}

}  // namespace
}  // namespace moe_reroute::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moe_reroute;
  static fuzz::MemoryFile file;
  static fuzz::MemoryFile copy;
  if (size == 0) return 0;
  const std::optional<std::string> name = fuzz::dtype_name(data[0]);
  tools::LoadedTensor loaded;
  try {
    loaded = tools::load_tensor(file.write(data + 1, size - 1), "tokens", name, "--tokens-dtype");
  } catch (const Error& e) {
    fuzz::require(std::string(e.what()).rfind("tokens: ", 0) == 0,
                  std::string("the message does not name the argument: ") + e.what());
    return 0;
  }
  const tools::NpyArray& array = loaded.array;
  fuzz::require(loaded.view.nbytes() == static_cast<std::int64_t>(array.data.size()),
                "the view describes " + std::to_string(loaded.view.nbytes()) + " bytes, the file " +
                    std::to_string(array.data.size()));
  fuzz::require(loaded.view.data == array.data.data(), "the view does not point at the data");

  const std::string header = tools::npy_header(array.descr, array.shape);
  std::string rewritten = header;
  rewritten.append(reinterpret_cast<const char*>(array.data.data()), array.data.size());
  const tools::NpyArray again =
      tools::read_npy(copy.write(rewritten.data(), rewritten.size()), "copy");
  fuzz::require(
      again.descr == array.descr && again.shape == array.shape && again.data == array.data,
      "written back, the file reads differently");
  return 0;
}
