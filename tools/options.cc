// The options and exit statuses moe-reroute shares with the benchmark.

#include "options.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <new>
#include <optional>
#include <string>
#include <type_traits>

#include "moe_reroute/error.h"

namespace moe_reroute::tools {
namespace {

constexpr int kBadInput = 2;

// CLI11 2.1 reads an int64 or uint64 option with strtoll / strtoull, which
// clamp a value past the type to its limit (and strtoull wraps "-1"), so
// checks would see, and quote, another number: refuse it here as typed.
template <typename Int>
CLI::Option* add_checked_int_option(CLI::App& command, const std::string& name, Int& value,
                                    const std::string& description) {
  static_assert(sizeof(Int) == 8);
  static const CLI::Validator fits(
      [](const std::string& typed) -> std::string {
        char* end = nullptr;
        errno = 0;
        if constexpr (std::is_signed_v<Int>) {
          std::strtoll(typed.c_str(), &end, 0);
        } else {
          std::strtoull(typed.c_str(), &end, 0);
        }
        const bool number = !typed.empty() && end == typed.c_str() + typed.size();
        const bool negative = std::is_unsigned_v<Int> && typed.find('-') != std::string::npos;
        if (!number || (errno != ERANGE && !negative)) return "";  // CLI11 refuses non-numbers
        return typed + " does not fit in " + (std::is_signed_v<Int> ? "int64" : "uint64");
      },
      "");
  return command.add_option(name, value, description)->check(fits);
}

[[noreturn]] void fail(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

DType named_dtype(const std::string& name, const char* flag) {
  const std::optional<DType> dtype = dtype_from_name(name);
  if (!dtype) fail(std::string(flag) + ": unknown dtype name '" + name + "'");
  return *dtype;
}

[[noreturn]] void bad_scales(const std::string& value) {
  fail("--scales: '" + value +
       "' must be none, f32, f32xS, f32k2, e8m0a, e8m0xS or e8m0 with S >= 1");
}

// "f32x4" -> 4 for prefix "f32x"; throws for anything but a positive integer.
std::int64_t columns_after(const std::string& value, const std::string& prefix) {
  const std::string digits = value.substr(prefix.size());
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
      digits.size() > 9 || std::stoll(digits) < 1) {
    bad_scales(value);
  }
  return std::stoll(digits);
}

}  // namespace

CLI::Option* add_int_option(CLI::App& command, const std::string& name, std::int64_t& value,
                            const std::string& description) {
  return add_checked_int_option(command, name, value, description);
}

CLI::Option* add_int_option(CLI::App& command, const std::string& name, std::uint64_t& value,
                            const std::string& description) {
  return add_checked_int_option(command, name, value, description);
}

CLI::Option* add_threads_option(CLI::App& command, int& threads) {
  // CLI::NonNegativeNumber's message spelled out the largest double.
  static const CLI::Validator count(
      [](const std::string& value) -> std::string {
        if (!value.starts_with('-')) return "";
        return "must be >= 0 (0 = all hardware threads), got " + value;
      },
      "");
  return command.add_option("--threads", threads, "threads, 0 = all hardware threads")
      ->check(count);
}

std::string flag_name(std::string_view name) {
  std::string flag = "--" + std::string(name);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

template <typename A>
void add_attribute_options(CLI::App& command, const OperatorDescOf<A>& op, A& attributes,
                           bool with_flags, std::string* dtype_name) {
  for (const AttributeDescOf<A>& attribute : op.attributes) {
    const std::string flag = flag_name(attribute.name);
    const std::string help(attribute.help);
    if (attribute.kind == AttributeKind::kInt) {
      add_int_option(command, flag, attributes.*attribute.int_member, help)->capture_default_str();
    } else if (attribute.kind == AttributeKind::kBool && with_flags) {
      command.add_flag(flag, attributes.*attribute.bool_member, help);
    } else if (attribute.kind == AttributeKind::kDTypeName && dtype_name) {
      command.add_option(flag, *dtype_name, help);
    }
  }
}

template void add_attribute_options(CLI::App&, const OperatorDesc&, Attributes&, bool,
                                    std::string*);
template void add_attribute_options(CLI::App&, const InitRoutingDesc&, InitRoutingAttributes&,
                                    bool, std::string*);
template void add_attribute_options(CLI::App&, const FinalizeRoutingDesc&,
                                    FinalizeRoutingAttributes&, bool, std::string*);

void add_workload_options(CLI::App& command, WorkloadOptions& w) {
  add_int_option(command, "--tokens", w.tokens, "A, tokens")->capture_default_str();
  add_int_option(command, "--hidden", w.hidden, "H, elements per token")->capture_default_str();
  add_int_option(command, "--ranks", w.ranks, "N, source ranks")->capture_default_str();
  add_int_option(command, "--experts", w.experts, "E, local experts")->capture_default_str();
  command.add_option("--tokens-dtype", w.tokens_dtype, "token dtype name")->capture_default_str();
  command.add_option("--counts-dtype", w.counts_dtype, "int32 or int64")->capture_default_str();
  command
      .add_option("--scales", w.scales,
                  "none, f32 ([A]), f32xS ([A, S]), f32k2 ([A, ceil(H/64), 2]), e8m0a ([A]), "
                  "e8m0xS ([A, S]), e8m0 ([A, ceil(H/64), 2])")
      ->capture_default_str();
  command.add_flag("--topk-weight,!--no-topk-weight", w.topk_weight, "give [A, 1] top-k weights");
  command.add_option("--skew", w.skew, "count skew, 0 = uniform")->capture_default_str();
  add_int_option(command, "--seed", w.seed, "random seed")->capture_default_str();
  add_attribute_options(command, reroute_desc(), w.attributes, /*with_flags=*/false, nullptr);
  add_int_option(command, "--valid-tokens", w.valid_tokens,
                 "rows the counts cover, the rest spare (allow_spare_rows); -1 = all")
      ->capture_default_str();
}

testing::WorkloadConfig workload_config(const WorkloadOptions& o) {
  testing::WorkloadConfig config;
  config.num_tokens = o.tokens;
  config.hidden = o.hidden;
  config.num_ranks = o.ranks;
  config.num_experts = o.experts;
  config.token_dtype = named_dtype(o.tokens_dtype, "--tokens-dtype");
  config.count_dtype = named_dtype(o.counts_dtype, "--counts-dtype");
  config.has_weight = o.topk_weight;
  config.skew = o.skew;
  config.seed = o.seed;
  config.attributes = o.attributes;
  config.attributes.allow_spare_rows = o.valid_tokens >= 0;
  config.num_valid_tokens = o.valid_tokens;
  if (o.tokens < 0 || o.hidden < 1 || o.ranks < 1 || o.experts < 1) {
    fail("--tokens >= 0, --hidden >= 1, --ranks >= 1 and --experts >= 1 are required");
  }
  if (o.valid_tokens < -1) {
    fail("--valid-tokens: must be -1 (all) or 0 to --tokens, got " +
         std::to_string(o.valid_tokens));
  }
  if (o.valid_tokens > o.tokens) {
    fail("--valid-tokens: " + std::to_string(o.valid_tokens) + " exceeds --tokens " +
         std::to_string(o.tokens));
  }
  config.has_scales = o.scales != "none";
  if (o.scales == "f32") {
    config.scale_dtype = DType::kFloat32;
  } else if (o.scales.starts_with("f32x")) {
    config.scale_dtype = DType::kFloat32;
    config.scale_tail = {columns_after(o.scales, "f32x")};
  } else if (o.scales == "f32k2") {
    config.scale_dtype = DType::kFloat32;
    config.scale_tail = {(o.hidden + 63) / 64, 2};
  } else if (o.scales == "e8m0a") {
    config.scale_dtype = DType::kFloat8E8M0;
  } else if (o.scales == "e8m0") {
    config.scale_dtype = DType::kFloat8E8M0;
    config.scale_tail = {(o.hidden + 63) / 64, 2};
  } else if (o.scales.starts_with("e8m0x")) {
    config.scale_dtype = DType::kFloat8E8M0;
    config.scale_tail = {columns_after(o.scales, "e8m0x")};
  } else if (config.has_scales) {
    bad_scales(o.scales);
  }
  // The core's own checks of shapes, dtypes and attributes, before the
  // workload allocates outputs by them (an alignment of 0 would size
  // them negative).
  infer_reroute(testing::meta_inputs(config), config.attributes);
  return config;
}

int parse_and_run(CLI::App& app, int argc, char** argv, const std::function<int()>& command) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::cerr << "error: " << e.what() << "\n";
    return kBadInput;
  }
  try {
    return command();
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return kBadInput;
  } catch (const std::bad_alloc&) {
    std::cerr << "error: out of memory: the inputs and outputs do not fit in this machine's "
                 "memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace moe_reroute::tools
