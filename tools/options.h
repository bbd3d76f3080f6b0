#pragma once

// What moe-reroute shares with the benchmark (bench/cpu_bench.cc): checked
// integer and thread options, the workload flags of `gen` and the benchmark,
// and the exit statuses of both programs.

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "moe_reroute/operator.h"
#include "workload.h"

namespace moe_reroute::tools {

/// An int64 or uint64 option; a value past its type is refused as typed.
CLI::Option* add_int_option(CLI::App& command, const std::string& name, std::int64_t& value,
                            const std::string& description);
CLI::Option* add_int_option(CLI::App& command, const std::string& name, std::uint64_t& value,
                            const std::string& description);

/// `--name-with-dashes` for the attribute `name`.
std::string flag_name(std::string_view name);

/// One option per int attribute of `op` (and, with `with_flags`, a flag per
/// bool attribute), named and described by the operator's description, into
/// `attributes`; `dtype_name`, where given, takes the dtype-name attribute.
/// Defined for the attribute structs of reroute.h and routing.h.
template <typename A>
void add_attribute_options(CLI::App& command, const OperatorDescOf<A>& op, A& attributes,
                           bool with_flags, std::string* dtype_name);

/// --threads N, N >= 0 (0 = all hardware threads).
CLI::Option* add_threads_option(CLI::App& command, int& threads);

/// The workload `gen` and the benchmark build; the defaults are the reference
/// library's example (A = 16384, H = 7168, int8, 16 ranks x 16 experts).
struct WorkloadOptions {
  std::int64_t tokens = 16384;
  std::int64_t hidden = 7168;
  std::int64_t ranks = 16;
  std::int64_t experts = 16;
  std::string tokens_dtype = "int8";
  std::string counts_dtype = "int32";
  // none, f32 ([A]), f32xS, f32k2 ([A, K, 2], K = ceil(H/64)), e8m0a ([A]), e8m0xS, e8m0 ([A, K, 2])
  std::string scales = "f32";
  bool topk_weight = true;
  double skew = 0.0;
  std::uint64_t seed = 0;
  Attributes attributes;  // allow_spare_rows follows valid_tokens
  std::int64_t valid_tokens = -1;  // rows the counts cover; -1: all (else allow_spare_rows)
};

/// The workload flags (--tokens, --hidden, ..., --valid-tokens) into `options`.
void add_workload_options(CLI::App& command, WorkloadOptions& options);

/// The testing workload for `options`; throws Error naming the flag for an
/// unknown dtype name or scales form.
testing::WorkloadConfig workload_config(const WorkloadOptions& options);

/// Parses the command line into `app`, then returns `command()`'s status. Bad
/// input of any kind (a flag, or an Error from the command) exits with status
/// 2 and one `error:` line on stderr; any other failure with status 1.
int parse_and_run(CLI::App& app, int argc, char** argv, const std::function<int()>& command);

}  // namespace moe_reroute::tools
