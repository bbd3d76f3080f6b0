// moe_reroute::ep through the installed package, on one rank: three tokens,
// top-2 of two experts; checks dispatch's rows and combine's sums.

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "moe_reroute/ep.h"

namespace mr = moe_reroute;
namespace ep = moe_reroute::ep;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const std::uint8_t x[] = {10, 11, 12};
  const std::int32_t ids[] = {1, 0, 1, 0, 0, 1};
  ep::DispatchResult d = ep::dispatch(MPI_COMM_WORLD,
                                      {.x = {x, mr::DType::kUInt8, {3, 1}},
                                       .expert_idx = {ids, mr::DType::kInt32, {3, 2}}},
                                      {.num_experts = 2});
  const std::uint8_t expected[] = {10, 11, 12, 10, 11, 12};  // expert 0, then expert 1
  bool ok = std::memcmp(d.outputs.permute_tokens.data(), expected, 6) == 0;
  const float expert_out[] = {1, 2, 3, 4, 5, 6};
  const ep::Tensor out = ep::combine({expert_out, mr::DType::kFloat32, {6, 1}}, d.handle);
  const float sums[] = {1 + 4, 2 + 5, 3 + 6};
  ok = ok && std::memcmp(out.data(), sums, sizeof(sums)) == 0;
  MPI_Finalize();
  if (!ok) {
    std::fprintf(stderr, "moe_reroute::ep differs from the expected rows\n");
    return 1;
  }
  std::printf("moe_reroute::ep ok\n");
  return 0;
}
