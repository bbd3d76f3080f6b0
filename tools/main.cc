// moe-reroute: the operator, its inverse, a verified benchmark and an input
// generator on the command line. Bad input of any kind exits with status 2 and
// one `error:` line on stderr.

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <new>
#include <string>
#include <type_traits>

#include "commands.h"
#include "moe_reroute/error.h"
#include "moe_reroute/version.h"

namespace {

using moe_reroute::tools::BenchOptions;
using moe_reroute::tools::GenOptions;
using moe_reroute::tools::RunOptions;
using moe_reroute::tools::WorkloadOptions;

constexpr int kBadInput = 2;

// --threads: CLI::NonNegativeNumber's message spelled out the largest double.
const CLI::Validator kThreadCount(
    [](const std::string& value) -> std::string {
      if (!value.starts_with('-')) return "";
      return "must be >= 0 (0 = all hardware threads), got " + value;
    },
    "");

// An int64 or uint64 option. CLI11 2.1 reads one with strtoll / strtoull,
// which clamp a value past the type to its limit (and strtoull wraps "-1"),
// so checks would see, and quote, another number: refuse it here as typed.
template <typename Int>
CLI::Option* add_int_option(CLI::App& command, const std::string& name, Int& value,
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

void add_run_options(CLI::App& command, RunOptions& o, bool forward) {
  command.add_option("--tokens", o.tokens, "tokens .npy, [A, H]")->required();
  command.add_option("--counts", o.counts, "expert_token_num_per_rank .npy, [N, E] int32/int64")
      ->required();
  command.add_option("--scales", o.scales, "per_token_scales .npy");
  command.add_option("--topk-weight", o.topk_weight, "expert_topk_weight .npy, [A, 1] float32");
  command.add_option("--tokens-dtype", o.tokens_dtype,
                     "logical dtype of the tokens storage (bfloat16 for <u2; FP8, hifloat8, "
                     "FP4 for uint8)");
  command.add_option("--scales-dtype", o.scales_dtype, "float8_e8m0 for uint8 scales");
  if (forward) {
    add_int_option(command, "--idx-type", o.idx_type, "0 = gather index, 1 = scatter index");
    add_int_option(command, "--expert-token-num-type", o.expert_token_num_type,
                   "0 = cumsum, 1 = count");
  }
  add_int_option(command, "--expert-alignment", o.expert_alignment,
                 "k: pad each expert's segment to a multiple of k rows (docs/spec.md section 9)");
  command.add_flag("--allow-spare-rows", o.allow_spare_rows,
                   "the counts may sum to less than A (fixed-capacity buffers)");
  command.add_option("--threads", o.threads, "threads, 0 = all hardware threads")
      ->check(kThreadCount);
  command.add_option("--out", o.out, "output directory (created if missing)")->required();
}

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
  add_int_option(command, "--idx-type", w.idx_type, "0 = gather index, 1 = scatter index")
      ->capture_default_str();
  add_int_option(command, "--expert-token-num-type", w.expert_token_num_type,
                 "0 = cumsum, 1 = count")
      ->capture_default_str();
  add_int_option(command, "--expert-alignment", w.expert_alignment,
                 "k, the expert segment alignment")
      ->capture_default_str();
  add_int_option(command, "--valid-tokens", w.valid_tokens,
                 "rows the counts cover, the rest spare (allow_spare_rows); -1 = all")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe-reroute: MoE token re-routing (MoeReRoutingV2) on .npy files"};
  app.set_version_flag("--version", MOE_REROUTE_VERSION_STRING);
  app.require_subcommand(1);
  std::function<int()> command;

  RunOptions run_options;
  CLI::App* run = app.add_subcommand("run", "reorder tokens from rank order to expert order");
  add_run_options(*run, run_options, true);
  run->callback([&] { command = [&] { return moe_reroute::tools::run_command(run_options); }; });

  RunOptions inverse_options;
  CLI::App* inverse = app.add_subcommand("inverse", "put expert-ordered rows back in rank order");
  add_run_options(*inverse, inverse_options, false);
  inverse->callback(
      [&] { command = [&] { return moe_reroute::tools::inverse_command(inverse_options); }; });

  BenchOptions bench_options;
  CLI::App* bench = app.add_subcommand("bench", "verify, then time against a plain copy");
  add_workload_options(*bench, bench_options.workload);
  bench->add_option("--threads", bench_options.threads, "threads, 0 = all hardware threads")
      ->check(kThreadCount);
  bench->add_option("--repeat", bench_options.repeat, "timed rounds")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  bench->add_flag("--json", bench_options.json, "print a JSON object as the last line");
  bench->callback(
      [&] { command = [&] { return moe_reroute::tools::bench_command(bench_options); }; });

  GenOptions gen_options;
  gen_options.workload.tokens = 256;
  CLI::App* gen = app.add_subcommand("gen", "write random valid inputs for `run`");
  add_workload_options(*gen, gen_options.workload);
  gen->add_option("--out", gen_options.out, "output directory (created if missing)")->required();
  gen->callback([&] { command = [&] { return moe_reroute::tools::gen_command(gen_options); }; });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::cerr << "error: " << e.what() << "\n";
    return kBadInput;
  }
  try {
    return command();
  } catch (const moe_reroute::Error& e) {
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
