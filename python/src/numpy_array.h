#pragma once

// What the nanobind modules (_core, _ep) share: NumPy arrays (ml_dtypes ones
// included) read as core views through the buffer protocol, and the one
// translation of Error into Python's exceptions.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "adapter.h"

namespace moe_reroute::py {

namespace nb = nanobind;

// A NumPy array's bytes through the buffer protocol, held until the argument
// is dropped. No format is asked for, so ml_dtypes arrays qualify too, and no
// contiguity, so that view() can name the argument.
struct BufferRelease {
  void operator()(Py_buffer* view) const {
    PyBuffer_Release(view);
    delete view;
  }
};
using Buffer = std::unique_ptr<Py_buffer, BufferRelease>;

Buffer buffer_of(nb::handle array, bool writable);

// A tensor's metadata alone (_core's bound class Argument), which the torch
// fake kernels describe for the shape rules: no data, a device and a layout.
struct Argument {
  std::string name;
  std::string storage;  // the storage dtype's name, as the framework spells it
  int bits = 0;
  std::vector<std::int64_t> shape;
  std::optional<std::string> device;  // a framework's name ("cpu", "cuda:0")
  bool contiguous = true;
};

// One argument of a call: an Argument, or a NumPy array described by its
// dtype and shape, its bytes held while the call reads them.
struct Arg : Argument {
  nb::object array;
  Buffer buffer;
};

// Argument `name` of a call: None, an Argument, or a NumPy array
// (`writable`: an output).
std::optional<Arg> arg_of(nb::handle object, std::string_view name, bool writable);

adapter::Storage storage(const Arg& arg);

// The core view of `arg`, refused as the torch kernels refuse it: off
// `device` (tokens' device, where described), not contiguous, or of a dtype
// the core does not take as `logical`.
TensorView view(const Arg& arg, const std::optional<std::string>& device,
                const std::optional<std::string>& logical, const char* logical_arg);

// Makes Error raise TypeError (unsupported), ValueError (invalid argument,
// out of range) or RuntimeError (backend) with its message. Once per module.
void translate_errors();

}  // namespace moe_reroute::py
