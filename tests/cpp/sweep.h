#pragma once

// Sweeps over the operator's dtypes and argument layouts, and the calls that
// run the library on a testing::Workload and compare it with the naive
// reference.

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "moe_reroute/reroute.h"
#include "workload.h"

namespace moe_reroute::test {

/// Every dtype of the table that tokens may hold (docs/spec.md section 2).
std::vector<DType> token_dtypes();

/// Every dtype of the table (the inverse moves rows of any dtype).
std::vector<DType> all_dtypes();

/// "forward" or "inverse".
std::string direction_name(Direction direction);

/// Names a test parameterized by a DType after the dtype (gtest's name generator).
struct DTypeParamName {
  template <typename ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    return std::string(dtype_name(info.param));
  }
};

enum class ScaleForm {
  kNone, kFloat32A, kFloat32AS, kFloat32AK2, kE8m0A, kE8m0AS, kE8m0AK2
};
inline constexpr ScaleForm kScaleForms[] = {ScaleForm::kNone,       ScaleForm::kFloat32A,
                                            ScaleForm::kFloat32AS,  ScaleForm::kFloat32AK2,
                                            ScaleForm::kE8m0A,      ScaleForm::kE8m0AS,
                                            ScaleForm::kE8m0AK2};
/// "none", "f32_A", "f32_AS", "f32_AK2", "e8m0_A", "e8m0_AS", "e8m0_AK2".
std::string scale_form_name(ScaleForm form);
/// The pairing table of docs/spec.md rule 7, written out here for the tests:
/// whether the forward takes scales of `form` beside tokens of `token_dtype`.
bool scales_pair(DType token_dtype, ScaleForm form);
/// Every (token dtype, scale form) the forward takes (`accepted`) or refuses.
std::vector<std::tuple<DType, ScaleForm>> scale_pairings(bool accepted);
/// Sets the config's scales to `form`; S is `width`, K is hidden / 64 (at least 1).
void set_scale_form(testing::WorkloadConfig& config, ScaleForm form, std::int64_t width = 3);

enum class WeightForm { kA1, kA, kNone };
inline constexpr WeightForm kWeightForms[] = {WeightForm::kA1, WeightForm::kA, WeightForm::kNone};
std::string weight_form_name(WeightForm form);

inline constexpr DType kCountDTypes[] = {DType::kInt32, DType::kInt64};

/// A forward or inverse call: the workload's config and the weight's layout.
struct Case {
  testing::WorkloadConfig config;
  WeightForm weight = WeightForm::kA1;
  /// "A=.. H=.. N=.. E=.. tokens=.. counts=.. scales=.. weight=.. idx_type=.. type=..".
  std::string to_string() const;
};

/// A Case with seeded random sizes: N, E in [1, 8], A in [0, 300], H in [1, 160]
/// (even for FP4).
Case random_case(DType token_dtype, ScaleForm scales, std::uint64_t seed);

/// Random cases of `token_dtype` and `scales` over every count dtype and
/// weight layout and, when `every_attribute`, every idx_type and
/// expert_token_num_type; seeded by `seed`.
std::vector<Case> sweep_cases(DType token_dtype, ScaleForm scales, bool every_attribute,
                              std::uint64_t seed);

/// An edge shape every direction and dtype is checked on.
struct Edge {
  std::string name;
  std::int64_t num_ranks;
  std::int64_t num_experts;
  std::int64_t num_tokens;
  std::int64_t hidden;
  double skew = 0.0;
  double zero_fraction = 0.0;
};

/// Zero counts, one block holding every token, N = 1, E = 1, A = 0,
/// H = 20000, a sparse 64 x 64 count matrix, skewed counts.
std::vector<Edge> edges();

/// A case on `edge` with float32 [A, 2] scales and an [A, 1] weight.
Case edge_case(const Edge& edge, DType token_dtype, std::uint64_t seed);

struct ForwardCall {
  RerouteInputs inputs;
  RerouteOutputs outputs;
};

struct InverseCall {
  InverseInputs inputs;
  InverseOutputs outputs;
};

/// The forward over `workload`'s buffers with the weight laid out as `weight`
/// (the workload must hold a weight unless `weight` is kNone).
ForwardCall forward_call(testing::Workload& workload, WeightForm weight);

/// The inverse over the same buffers: the workload's inputs taken as expert
/// ordered rows, its permute_* buffers as the restored outputs.
InverseCall inverse_call(testing::Workload& workload, WeightForm weight);

/// Runs the forward on `num_threads` threads; "" when every output equals the
/// naive reference byte for byte, else the first difference.
std::string forward_difference(const Case& c, int num_threads);

/// The same for the inverse (restored tokens, scales and weight).
std::string inverse_difference(const Case& c, int num_threads);

/// forward_difference or inverse_difference.
std::string difference(Direction direction, const Case& c, int num_threads);

/// "" when the workload's restored rows equal reference_inverse byte for byte.
std::string inverse_outputs_difference(const testing::Workload& workload);

/// Runs `call`; "" when it throws Error with `code` and a message holding
/// every one of `parts` (the argument's name, the offending value), else
/// what happened instead.
std::string refusal_difference(const std::function<void()>& call, ErrorCode code,
                               const std::vector<std::string>& parts);

}  // namespace moe_reroute::test
