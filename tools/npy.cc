#include "npy.h"

#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "moe_reroute/dtype.h"
#include "moe_reroute/error.h"

namespace moe_reroute::tools {
namespace {

static_assert(std::endian::native == std::endian::little,
              ".npy data is read in place: '=' and '<' must mean the same");

constexpr std::string_view kMagic = "\x93NUMPY";
// numpy itself refuses headers past 10000 bytes unless told otherwise; this
// bounds what a corrupt length field can make us allocate.
constexpr std::size_t kMaxHeaderBytes = 1 << 20;

[[noreturn]] void fail(std::string_view argument, const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, std::string(argument) + ": " + message);
}

std::string supported_descrs() {
  std::string list;
  for (const DTypeInfo& info : dtype_table()) {
    if (list.find(info.npy_storage) == std::string::npos) {
      if (!list.empty()) list += ' ';
      list += info.npy_storage;
    }
  }
  return list;
}

bool is_table_storage(std::string_view descr) {
  for (const DTypeInfo& info : dtype_table()) {
    if (info.npy_storage == descr) return true;
  }
  return false;
}

// A cursor over the header dict, a small subset of Python literal syntax.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, std::string_view argument)
      : text_(text), argument_(argument) {}

  NpyArray parse() {
    NpyArray array;
    bool has_descr = false, has_order = false, has_shape = false;
    expect('{');
    while (!peek('}')) {
      const std::string key = parse_string();
      expect(':');
      if (key == "descr") {
        skip_space();
        if (peek('[')) fail(argument_, "structured dtypes are not supported");
        array.descr = normalize_descr(parse_string(), argument_);
        has_descr = true;
      } else if (key == "fortran_order") {
        if (parse_bool())
          fail(argument_, "Fortran-order arrays are not supported; save it C-ordered");
        has_order = true;
      } else if (key == "shape") {
        array.shape = parse_shape();
        has_shape = true;
      } else {
        fail(argument_, "unexpected key '" + key + "' in the .npy header");
      }
      if (!peek('}')) expect(',');
    }
    expect('}');
    skip_space();
    if (pos_ != text_.size()) garbage();
    if (!has_descr || !has_order || !has_shape) {
      fail(argument_, "the .npy header lacks 'descr', 'fortran_order' or 'shape'");
    }
    return array;
  }

 private:
  [[noreturn]] void garbage() const {
    fail(argument_, "malformed .npy header at byte " + std::to_string(pos_) + ": " +
                        std::string(text_.substr(0, 80)));
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool peek(char c) {
    skip_space();
    return pos_ < text_.size() && text_[pos_] == c;
  }
  void expect(char c) {
    if (!peek(c)) garbage();
    ++pos_;
  }
  std::string parse_string() {
    skip_space();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) garbage();
    const char quote = text_[pos_++];
    const std::size_t end = text_.find(quote, pos_);
    if (end == std::string_view::npos) garbage();
    std::string value(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return value;
  }
  bool parse_bool() {
    skip_space();
    for (const auto& [word, value] : {std::pair{"True", true}, std::pair{"False", false}}) {
      if (text_.substr(pos_, std::strlen(word)) == word) {
        pos_ += std::strlen(word);
        return value;
      }
    }
    garbage();
  }
  std::vector<std::int64_t> parse_shape() {
    std::vector<std::int64_t> shape;
    expect('(');
    while (!peek(')')) {
      if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) garbage();
      std::int64_t dim = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        if (__builtin_mul_overflow(dim, 10, &dim) ||
            __builtin_add_overflow(dim, text_[pos_] - '0', &dim)) {
          fail(argument_, "a dim of the .npy shape overflows int64");
        }
        ++pos_;
      }
      shape.push_back(dim);
      if (!peek(')')) expect(',');
    }
    expect(')');
    if (shape.size() > static_cast<std::size_t>(kMaxDims)) {
      fail(argument_, std::to_string(shape.size()) + "-D array, at most " +
                          std::to_string(kMaxDims) + " dims are supported");
    }
    return shape;
  }

  std::string_view text_;
  std::string_view argument_;
  std::size_t pos_ = 0;
};

std::uint32_t little_endian(const unsigned char* bytes, int size) {
  std::uint32_t value = 0;
  for (int i = size - 1; i >= 0; --i) value = value << 8 | bytes[i];
  return value;
}

}  // namespace

std::string normalize_descr(std::string_view descr, std::string_view argument) {
  std::string_view body = descr;
  char order = '=';
  if (!body.empty() && std::string_view("<>|=").find(body[0]) != std::string_view::npos) {
    order = body[0];
    body.remove_prefix(1);
  }
  const bool well_formed = body.size() >= 2 && std::isalpha(static_cast<unsigned char>(body[0])) &&
                           body.find_first_not_of("0123456789", 1) == std::string_view::npos;
  if (!well_formed) fail(argument, "unknown .npy descr '" + std::string(descr) + "'");
  const bool single_byte = body.substr(1) == "1";
  if (!single_byte && order == '>') {
    fail(argument, "big-endian data ('" + std::string(descr) +
                       "') is not supported; save it "
                       "little-endian");
  }
  if (!single_byte && order == '|') {
    fail(argument, ".npy descr '" + std::string(descr) + "' has no byte order");
  }
  std::string normalized(1, single_byte ? '|' : '<');
  normalized += body;
  if (!is_table_storage(normalized)) {
    fail(argument, ".npy descr '" + std::string(descr) +
                       "' is not supported (supported: " + supported_descrs() + ")");
  }
  return normalized;
}

NpyArray parse_npy_header(std::string_view header, std::string_view argument) {
  return HeaderParser(header, argument).parse();
}

NpyArray read_npy(const std::filesystem::path& path, std::string_view argument) {
  const std::string name = path.string();
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!file) fail(argument, "cannot open " + name + ": " + std::strerror(errno));

  unsigned char preamble[12];
  const std::size_t got = std::fread(preamble, 1, 10, file.get());
  if (got < kMagic.size() || std::memcmp(preamble, kMagic.data(), kMagic.size()) != 0) {
    fail(argument, name + " is not a .npy file (no \\x93NUMPY magic)");
  }
  if (got < 10) fail(argument, name + " is truncated inside the .npy preamble");
  const int major = preamble[6];
  if (major < 1 || major > 3 || preamble[7] != 0) {
    fail(argument, name + ": .npy format version " + std::to_string(major) + "." +
                       std::to_string(preamble[7]) + " is not supported (1.0, 2.0, 3.0 are)");
  }
  std::size_t header_bytes = little_endian(preamble + 8, 2);
  if (major >= 2) {
    if (std::fread(preamble + 10, 1, 2, file.get()) != 2) {
      fail(argument, name + " is truncated inside the .npy preamble");
    }
    header_bytes = little_endian(preamble + 8, 4);
  }
  if (header_bytes > kMaxHeaderBytes) {
    fail(argument, name + ": .npy header of " + std::to_string(header_bytes) +
                       " bytes is too long (at most " + std::to_string(kMaxHeaderBytes) + ")");
  }
  std::string header(header_bytes, '\0');
  if (std::fread(header.data(), 1, header_bytes, file.get()) != header_bytes) {
    fail(argument, name + " is truncated inside the .npy header");
  }
  NpyArray array = parse_npy_header(header, argument);

  std::int64_t elements = 1;
  for (std::int64_t dim : array.shape) {
    if (__builtin_mul_overflow(elements, dim, &elements)) {
      fail(argument, name + ": shape overflows int64");
    }
  }
  const std::int64_t itemsize = std::stoll(array.descr.substr(2));
  std::int64_t data_bytes = 0;
  if (__builtin_mul_overflow(elements, itemsize, &data_bytes)) {
    fail(argument, name + ": shape overflows int64 bytes");
  }
  std::error_code error;
  const auto file_bytes = static_cast<std::int64_t>(std::filesystem::file_size(path, error));
  const std::int64_t data_start = std::ftell(file.get());
  if (!error && file_bytes - data_start != data_bytes) {
    fail(argument, name + ": the header promises " + std::to_string(data_bytes) +
                       " data bytes but the file holds " + std::to_string(file_bytes - data_start) +
                       (file_bytes - data_start < data_bytes ? " (truncated)" : ""));
  }
  array.data.resize(static_cast<std::size_t>(data_bytes));
  if (std::fread(array.data.data(), 1, array.data.size(), file.get()) != array.data.size()) {
    fail(argument, name + ": truncated data");
  }
  return array;
}

std::string npy_header(std::string_view descr, std::span<const std::int64_t> shape) {
  std::string dict = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]) + (shape.size() == 1 ? "," : i + 1 < shape.size() ? ", " : "");
  }
  dict += "), }";
  const bool version2 = dict.size() + 1 + 10 > 65535;
  const std::size_t preamble = version2 ? 12 : 10;
  const std::size_t total = (preamble + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - preamble - dict.size() - 1, ' ');
  dict += '\n';
  std::string out(kMagic);
  out += static_cast<char>(version2 ? 2 : 1);
  out += '\0';
  const std::size_t length = dict.size();
  for (std::size_t i = 0; i < (version2 ? 4u : 2u); ++i)
    out += static_cast<char>(length >> (8 * i) & 0xFF);
  return out + dict;
}

void write_npy(const std::filesystem::path& path, std::string_view descr,
               std::span<const std::int64_t> shape, const void* data, std::size_t bytes,
               std::string_view argument) {
  const std::string header = npy_header(descr, shape);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  out.close();
  if (!out) fail(argument, "cannot write " + path.string());
}

std::optional<DType> default_dtype(std::string_view descr) {
  const char kind = descr[1];
  const std::string prefix = kind == 'f'   ? "float"
                             : kind == 'i' ? "int"
                             : kind == 'u' ? "uint"
                                           : "";
  if (prefix.empty()) return std::nullopt;
  return dtype_from_name(prefix + std::to_string(8 * std::stoi(std::string(descr.substr(2)))));
}

std::string storage_descr(DType dtype) { return std::string(dtype_info(dtype).npy_storage); }

std::vector<std::int64_t> storage_shape(const TensorSpec& spec) {
  std::vector<std::int64_t> shape(spec.shape.dims.begin(),
                                  spec.shape.dims.begin() + spec.shape.ndim);
  if (dtype_info(spec.dtype).bits < 8 && !shape.empty()) shape.back() /= 2;
  return shape;
}

LoadedTensor load_tensor(const std::filesystem::path& path, std::string_view argument,
                         const std::optional<std::string>& dtype_name, std::string_view flag) {
  LoadedTensor loaded{read_npy(path, argument), {}};
  const std::string& descr = loaded.array.descr;
  std::optional<DType> dtype;
  if (dtype_name) {
    dtype = dtype_from_name(*dtype_name);
    if (!dtype)
      fail(argument, "unknown dtype name '" + *dtype_name + "' (" + std::string(flag) + ")");
    if (dtype_info(*dtype).npy_storage != descr) {
      fail(argument, std::string(flag) + " " + *dtype_name + " is stored as " +
                         storage_descr(*dtype) + ", but " + path.string() + " holds " + descr);
    }
  } else {
    dtype = default_dtype(descr);
    if (!dtype) {
      std::string names;
      for (const DTypeInfo& info : dtype_table()) {
        if (info.npy_storage != descr) continue;
        if (!names.empty()) names += ", ";
        names += info.name;
      }
      fail(argument,
           path.string() + " holds " + descr +
               (flag.empty() ? ", which this argument cannot hold"
                             : "; name its dtype with " + std::string(flag) + " (" + names + ")"));
    }
  }
  std::vector<std::int64_t> shape = loaded.array.shape;
  if (dtype_info(*dtype).bits < 8 && !shape.empty() &&
      __builtin_mul_overflow(shape.back(), 2, &shape.back())) {
    fail(argument, path.string() +
                       ": the last dim counts two FP4 elements a byte and then "
                       "overflows int64");
  }
  loaded.view = TensorView(loaded.array.data.data(), *dtype, Shape(shape));
  return loaded;
}

}  // namespace moe_reroute::tools
