// moe-reroute: the operator, its inverse, the routing operators on either side
// of the exchange and an input generator on the command line. Bad input of any
// kind exits with status 2 and one `error:` line on stderr.

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "commands.h"
#include "moe_reroute/version.h"

namespace {

using moe_reroute::tools::FinalizeRoutingOptions;
using moe_reroute::tools::GenOptions;
using moe_reroute::tools::InitRoutingOptions;
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

// One `--<input>` option per input of `op`, required unless the input is
// optional, into `o.paths` (in the inputs' order); then its attributes and the
// options every operator command takes.
template <typename A>
void add_operator_options(CLI::App& command, const moe_reroute::OperatorDescOf<A>& op,
                          moe_reroute::tools::OperatorOptions<A>& o) {
  o.paths.resize(op.inputs.size());
  for (std::size_t i = 0; i < op.inputs.size(); ++i) {
    const moe_reroute::InputDesc& input = op.inputs[i];
    CLI::Option* option = command.add_option(moe_reroute::tools::flag_name(input.name), o.paths[i],
                                             std::string(input.name) + " .npy");
    if (!input.optional) option->required();
  }
  moe_reroute::tools::add_attribute_options(command, op, o.attributes, /*with_flags=*/true,
                                            nullptr);
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

  InitRoutingOptions init_options;
  CLI::App* init = app.add_subcommand(
      "init-routing", "sort a rank's tokens by expert before the dispatch (moe_init_routing)");
  add_operator_options(*init, moe_reroute::init_routing_desc(), init_options);
  init->add_option("--x-dtype", init_options.x_dtype,
                   "the dtype of x's unsigned storage (bfloat16 for uint16; FP8, hifloat8, FP4 "
                   "for uint8)");
  init->callback(
      [&] { command = [&] { return moe_reroute::tools::init_routing_command(init_options); }; });

  FinalizeRoutingOptions finalize_options;
  CLI::App* finalize = app.add_subcommand(
      "finalize-routing",
      "sum each token's k expert outputs, weighted, after the combine (moe_finalize_routing)");
  add_operator_options(*finalize, moe_reroute::finalize_routing_desc(), finalize_options);
  finalize->add_option("--expanded-x-dtype", finalize_options.expanded_x_dtype,
                       "bfloat16 for uint16 expanded_x, x1, x2 and bias");
  finalize->add_option("--scales-dtype", finalize_options.scales_dtype,
                       "bfloat16 for uint16 scales");
  finalize->callback([&] {
    command = [&] { return moe_reroute::tools::finalize_routing_command(finalize_options); };
  });

  GenOptions gen_options;
  gen_options.workload.tokens = 256;
  CLI::App* gen = app.add_subcommand("gen", "write random valid inputs for `run`");
  moe_reroute::tools::add_workload_options(*gen, gen_options.workload);
  gen->add_option("--out", gen_options.out, "output directory (created if missing)")->required();
  gen->callback([&] { command = [&] { return moe_reroute::tools::gen_command(gen_options); }; });

  return moe_reroute::tools::parse_and_run(app, argc, argv, [&] { return command(); });
}
