// moe-reroute: the operator, its inverse and an input generator on the command
// line. Bad input of any kind exits with status 2 and one `error:` line on
// stderr.

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "commands.h"
#include "moe_reroute/version.h"

namespace {

using moe_reroute::tools::GenOptions;
using moe_reroute::tools::RunOptions;

void add_run_options(CLI::App& command, RunOptions& o, bool forward) {
  command.add_option("--tokens", o.tokens, "tokens .npy, [A, H]")->required();
  command.add_option("--counts", o.counts, "expert_token_num_per_rank .npy, [N, E] int32/int64")
      ->required();
  command.add_option("--scales", o.scales, "per_token_scales .npy");
  command.add_option("--topk-weight", o.topk_weight, "expert_topk_weight .npy, [A, 1] float32");
  command.add_option("--scales-dtype", o.scales_dtype, "float8_e8m0 for uint8 scales");
  moe_reroute::tools::add_attribute_options(
      command, forward ? moe_reroute::reroute_desc() : moe_reroute::inverse_desc(), o.attributes,
      /*with_flags=*/true, &o.tokens_dtype);
  moe_reroute::tools::add_threads_option(command, o.threads);
  command.add_option("--out", o.out, "output directory (created if missing)")->required();
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

  GenOptions gen_options;
  gen_options.workload.tokens = 256;
  CLI::App* gen = app.add_subcommand("gen", "write random valid inputs for `run`");
  moe_reroute::tools::add_workload_options(*gen, gen_options.workload);
  gen->add_option("--out", gen_options.out, "output directory (created if missing)")->required();
  gen->callback([&] { command = [&] { return moe_reroute::tools::gen_command(gen_options); }; });

  return moe_reroute::tools::parse_and_run(app, argc, argv, [&] { return command(); });
}
