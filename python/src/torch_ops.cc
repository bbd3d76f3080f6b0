// The torch operators moe_reroute::moe_re_routing, moe_re_routing_out and
// moe_re_routing_inverse: schemas, one kernel per op for CPU and CUDA tensors
// that calls the core directly, the autograd kernels, the per-device CUDA
// status word, the limit of the CPU output cache (output_cache.h), and the
// Python module moe_reroute._torch_ops with the eager entry points. The
// fake kernels are Python (moe_reroute/_torch.py) calling the core's
// infer_reroute / infer_inverse. Why the regular (not the stable) C++ API:
// docs/torch.md.

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>
#include <torch/python.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "adapter.h"
#include "output_cache.h"
#include "moe_reroute/moe_reroute.h"
#if MOE_REROUTE_HAS_CUDA
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "moe_reroute/cuda.h"

// The current CUDA stream from torch's C shim (libtorch_cuda), which declares
// it only when torch's own build defines USE_CUDA.
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(std::int32_t device_index,
                                                             void** ret_stream);
#endif

namespace moe_reroute::torch_ops {
namespace {

using adapter::fail;
using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using OptionalName = std::optional<c10::string_view>;
using Forward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Inverse = std::tuple<Tensor, Tensor, Tensor>;

constexpr auto kNumTorchDTypes = static_cast<std::size_t>(c10::ScalarType::NumOptions);

// A torch dtype's name in torch's Python API (torch.bfloat16: "bfloat16"), by
// which the core's dtype table knows it; torch's own names, read once. Which of
// the dtypes the operator takes is the table's business.
std::string_view python_name(c10::ScalarType type) {
  static const std::array<std::string, kNumTorchDTypes> names = [] {
    std::array<std::string, kNumTorchDTypes> names;
    for (std::size_t i = 0; i < kNumTorchDTypes; ++i) {
      if (static_cast<c10::ScalarType>(i) != c10::ScalarType::Undefined) {
        names[i] = std::string(c10::getDtypeNames(static_cast<c10::ScalarType>(i)).first);
      }
    }
    return names;
  }();
  return names[static_cast<std::size_t>(type)];
}

// Torch's dtypes against the table's, both ways, from torch's names, built once.
struct DTypeMap {
  std::array<std::optional<DType>, kNumTorchDTypes> table;  // by torch dtype
  std::vector<c10::ScalarType> torch;  // by table dtype; Undefined where torch has none
};

const DTypeMap& dtype_map() {
  static const DTypeMap map = [] {
    DTypeMap map;
    map.torch.assign(dtype_table().size(), c10::ScalarType::Undefined);
    for (std::size_t i = 0; i < kNumTorchDTypes; ++i) {
      const auto type = static_cast<c10::ScalarType>(i);
      const std::optional<DType> row = adapter::table_dtype(python_name(type));
      map.table[i] = row;
      // A row names torch's dtype by its torch name; its own name may be another's.
      if (row && dtype_info(*row).torch_name == python_name(type)) {
        map.torch[static_cast<std::size_t>(*row)] = type;
      }
    }
    return map;
  }();
  return map;
}

adapter::Storage storage(const Tensor& tensor) {
  const c10::ScalarType type = tensor.scalar_type();
  return {python_name(type), static_cast<int>(c10::elementSize(type)) * 8,
          dtype_map().table[static_cast<std::size_t>(type)]};
}

// The torch dtype of an output the core specifies by its own dtype.
c10::ScalarType torch_dtype(DType dtype) {
  const c10::ScalarType type = dtype_map().torch[static_cast<std::size_t>(dtype)];
  if (type == c10::ScalarType::Undefined) {
    fail(ErrorCode::kUnsupported,
         std::string("dtype ") + std::string(dtype_name(dtype)) + " has no torch dtype");
  }
  return type;
}

// Python's exception by the error's kind: TypeError, ValueError, RuntimeError.
[[noreturn]] void raise(const Error& error) {
  const c10::SourceLocation where{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)};
  switch (error.code()) {
    case ErrorCode::kUnsupported:
      throw c10::TypeError(where, error.what());
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:
      throw c10::ValueError(where, error.what());
    case ErrorCode::kBackend:
      break;
  }
  throw c10::Error(where, error.what());
}

template <typename Body>
auto translated(Body body) {
  try {
    return body();
  } catch (const Error& error) {
    raise(error);
  }
}

std::optional<std::string> name_of(const OptionalName& name) {
  if (!name) return std::nullopt;
  return std::string(*name);
}

void check_device(const Tensor& tensor, const char* arg, const c10::Device& device) {
  if (tensor.device() != device) adapter::fail_device(arg, device.str());
}

// `tensor`, refused where it is undefined (a None from Python).
const Tensor& given(const Tensor& tensor, const char* arg) {
  if (!tensor.defined()) adapter::fail_none(arg);
  return tensor;
}

// The device of a call: tokens', where the build has its backend.
c10::Device call_device(const Tensor& tokens) {
  if (given(tokens, "tokens").is_cpu() || (tokens.is_cuda() && MOE_REROUTE_HAS_CUDA)) {
    return tokens.device();
  }
  fail(ErrorCode::kInvalidArgument,
       std::string("tokens: must be in CPU memory") +
           (MOE_REROUTE_HAS_CUDA ? " or on a CUDA device"
                                 : " (this build has only the CPU backend)"));
}

// The core view of `tensor` (argument `arg`) on `device`, read as `logical` when named.
TensorView view(const Tensor& tensor, const char* arg, const std::optional<std::string>& logical,
                const char* logical_arg, const c10::Device& device) {
  check_device(given(tensor, arg), arg, device);
  if (!tensor.is_contiguous()) adapter::fail_not_contiguous(arg);
  const c10::IntArrayRef sizes = tensor.sizes();
  return adapter::core_view(tensor.data_ptr(), storage(tensor), {sizes.data(), sizes.size()}, arg,
                            logical, logical_arg);
}

// A fresh output. On the CPU it comes from output_cache.h's allocator, except
// where torch is asked to fill fresh memory (deterministic algorithms with
// fill_uninitialized_memory), which at::empty does.
Tensor empty(c10::IntArrayRef dims, c10::ScalarType type, const c10::Device& device) {
  const at::Context& context = at::globalContext();
  if (!device.is_cpu() ||
      (context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory())) {
    return at::empty(dims, at::TensorOptions().dtype(type).device(device));
  }
  // A storage that grows (resize_) takes its memory from the same allocator.
  return at::detail::empty_generic(dims, output_allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), type, std::nullopt);
}

// An output with `spec`'s rows stored like `input`, or, without an input, with
// `spec` itself in its torch dtype.
Tensor allocate(const TensorSpec& spec, const Tensor* input, const c10::Device& device) {
  if (input) {
    const Shape dims = adapter::stored_like(spec, input->sizes());
    return empty(c10::IntArrayRef(dims.dims.data(), dims.ndim), input->scalar_type(), device);
  }
  return empty(c10::IntArrayRef(spec.shape.dims.data(), spec.shape.ndim), torch_dtype(spec.dtype),
               device);
}

// `tensor` contiguous, copied where it is not; a copied one's own memory
// (argument `arg`) is added to `copied`.
Tensor contiguous(const Tensor& tensor, const char* arg, std::vector<ByteSpan>& copied) {
  Tensor dense = tensor.contiguous();
  if (!dense.is_same(tensor)) {
    const c10::IntArrayRef sizes = tensor.sizes();
    const c10::IntArrayRef strides = tensor.strides();
    const std::int64_t item_bytes = tensor.element_size();
    copied.push_back(adapter::strided_span(arg, tensor.data_ptr(), {sizes.data(), sizes.size()},
                                           {strides.data(), strides.size()}, item_bytes,
                                           item_bytes));
  }
  return dense;
}

// One call's inputs, contiguous (copied where they are not), and their views.
struct Call {
  c10::Device device;
  std::vector<ByteSpan> copied;  // the caller's memory of the copied inputs
  Tensor tokens;
  Tensor counts;
  OptionalTensor scales;
  OptionalTensor weight;
  std::optional<std::string> tokens_dtype;
  std::optional<std::string> scales_dtype;

  Call(const Tensor& tokens_in, const Tensor& counts_in, const OptionalTensor& scales_in,
       const OptionalTensor& weight_in, const OptionalName& tokens_name)
      : device(call_device(tokens_in)),
        tokens(contiguous(tokens_in, "tokens", copied)),
        counts(contiguous(given(counts_in, "expert_token_num_per_rank"),
                          "expert_token_num_per_rank", copied)),
        tokens_dtype(name_of(tokens_name)) {
    if (scales_in) {
      scales = contiguous(*scales_in, "per_token_scales", copied);
      scales_dtype = adapter::scales_dtype(storage(*scales));
    }
    if (weight_in) weight = contiguous(*weight_in, "expert_topk_weight", copied);
  }

  template <typename Inputs>
  Inputs inputs() const {
    Inputs inputs{view(tokens, "tokens", tokens_dtype, "tokens_dtype", device),
                  view(counts, "expert_token_num_per_rank", std::nullopt, "", device)};
    if (scales) {
      inputs.per_token_scales =
          view(*scales, "per_token_scales", scales_dtype, "per_token_scales", device);
    }
    if (weight) inputs.expert_topk_weight = view(*weight, "expert_topk_weight", std::nullopt, "", device);
    return inputs;
  }

  TensorView output(const Tensor& tensor, const char* arg, const std::optional<std::string>& logical) const {
    return view(tensor, arg, logical, arg, device);
  }
  TensorView output(const Tensor& tensor, const char* arg) const {
    return view(tensor, arg, std::nullopt, arg, device);
  }
  // The dtype name the scales outputs are read as: the scales' own, or none.
  std::optional<std::string> out_scales_dtype() const { return scales ? scales_dtype : std::nullopt; }

  // Fresh outputs for `specs` on the call's device, each stored as adapter.h's
  // `stored_like` says.
  template <typename Outputs, std::size_t N>
  Outputs allocate_outputs(const std::array<TensorSpec, N>& specs,
                           const std::array<int, N>& stored_like) const {
    const Tensor* inputs[] = {&tokens, &counts, scales ? &*scales : nullptr,
                              weight ? &*weight : nullptr};
    std::array<Tensor, N> tensors;
    for (std::size_t i = 0; i < N; ++i) {
      tensors[i] = allocate(specs[i],
                            stored_like[i] == adapter::kOwnSpec ? nullptr : inputs[stored_like[i]],
                            device);
    }
    return std::apply([](auto&... each) { return Outputs{std::move(each)...}; }, tensors);
  }
};

// Whether every CUDA call reads its device's status word ("sync" mode).
std::atomic<bool> sync_mode{false};

#if MOE_REROUTE_HAS_CUDA
std::int64_t dim_or_zero(const Tensor& tensor, std::int64_t d) {
  return tensor.dim() > d ? tensor.size(d) : 0;
}

// The status word of each CUDA device: sticky (kernels OR their bits in), read
// and cleared only by cuda_check or, in "sync" mode, after every call.
std::mutex status_mutex;
std::vector<Tensor> status_words;

// The word of `device`, made by its first call. That call is refused where
// `stream` is capturing: the word would come from the graph's memory pool and
// be zeroed only when the graph first replays.
Tensor status_word(const c10::Device& device, void* stream) {
  std::lock_guard<std::mutex> lock(status_mutex);
  const auto index = static_cast<std::size_t>(device.index());
  if (status_words.size() <= index) status_words.resize(index + 1);
  if (!status_words[index].defined()) {
    if (cuda::stream_is_capturing(stream)) {
      fail(ErrorCode::kBackend,
           "tokens: the first call on " + device.str() +
               " makes its status word, which cannot happen under CUDA graph capture; call "
               "the operator once on " + device.str() + " before capturing (a warm-up call)");
    }
    status_words[index] = at::zeros({2}, at::TensorOptions().dtype(c10::kInt).device(device));
  }
  return status_words[index];
}

// Reads the status word (one host sync), clears it and throws for bad counts.
void check_status(const Tensor& word) {
  const std::int32_t status = word[0].item<std::int32_t>();
  if (status == 0) return;
  word.zero_();
  fail(ErrorCode::kInvalidArgument, cuda::status_message(status));
}

void* current_stream(const c10::Device& device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(device.index(), &stream) != AOTI_TORCH_SUCCESS) {
    fail(ErrorCode::kBackend, "tokens: cannot get the current CUDA stream of " + device.str());
  }
  return stream;
}

// Runs `launch(context)` on the current stream of `call`'s device with a
// workspace from the caching allocator (graph-capturable: no host sync).
// Under capture, what capture cannot do (make the status word, sync mode's
// read) is refused before anything is launched; the capture status is asked
// only then, not on every deferred call.
template <typename Launch>
void run_cuda(const Call& call, Launch launch) {
  const c10::DeviceGuard guard(call.device);
  const std::size_t bytes = cuda::required_workspace_bytes(dim_or_zero(call.counts, 0),
                                                           dim_or_zero(call.counts, 1));
  void* const stream = current_stream(call.device);
  const Tensor word = status_word(call.device, stream);
  const bool sync = sync_mode.load(std::memory_order_relaxed);
  if (sync && cuda::stream_is_capturing(stream)) {
    fail(ErrorCode::kBackend,
         "set_cuda_status_check: \"sync\" reads the status word after every call, which "
         "cannot happen under CUDA graph capture; capture in \"deferred\" mode");
  }
  const Tensor workspace = at::empty({static_cast<std::int64_t>(bytes)},
                                     at::TensorOptions().dtype(c10::kByte).device(call.device));
  launch(cuda::DeviceContext{stream, word.data_ptr<std::int32_t>(), workspace.data_ptr(), bytes});
  if (sync) check_status(word);
}
#endif

void run([[maybe_unused]] const Call& call, const RerouteInputs& inputs,
         const RerouteOutputs& outputs, const Attributes& attributes) {
#if MOE_REROUTE_HAS_CUDA
  if (call.device.is_cuda()) {
    run_cuda(call, [&](const cuda::DeviceContext& context) {
      cuda::moe_re_routing(inputs, outputs, attributes, context);
    });
    return;
  }
#endif
  moe_re_routing(inputs, outputs, attributes);
}

void run([[maybe_unused]] const Call& call, const InverseInputs& inputs,
         const InverseOutputs& outputs, const Attributes& attributes) {
#if MOE_REROUTE_HAS_CUDA
  if (call.device.is_cuda()) {
    run_cuda(call, [&](const cuda::DeviceContext& context) {
      cuda::moe_re_routing_inverse(inputs, outputs, attributes, context);
    });
    return;
  }
#endif
  moe_re_routing_inverse(inputs, outputs, attributes);
}

Attributes attributes_of(std::int64_t expert_token_num_type, std::int64_t idx_type,
                         std::int64_t expert_alignment, bool allow_spare_rows) {
  return {expert_token_num_type, idx_type, expert_alignment, allow_spare_rows};
}

RerouteOutputs reroute_outputs(const Call& call, const Tensor& tokens, const Tensor& scales,
                               const Tensor& idx, const Tensor& num, const Tensor& weight) {
  return {call.output(tokens, "permute_tokens", call.tokens_dtype),
          call.output(scales, "permute_per_token_scales", call.out_scales_dtype()),
          call.output(idx, "permute_token_idx"), call.output(num, "expert_token_num"),
          call.output(weight, "permute_topk_weight")};
}

Forward reroute(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                const OptionalTensor& weight, std::int64_t expert_token_num_type,
                std::int64_t idx_type, OptionalName tokens_dtype, std::int64_t expert_alignment,
                bool allow_spare_rows) {
  return translated([&] {
    const Call call(tokens, counts, scales, weight, tokens_dtype);
    const RerouteInputs inputs = call.inputs<RerouteInputs>();
    const Attributes attributes =
        attributes_of(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows);
    Forward outputs = call.allocate_outputs<Forward>(
        adapter::output_specs(infer_reroute(inputs, attributes)), adapter::kForwardStoredLike);
    auto& [out_tokens, out_scales, out_idx, out_num, out_weight] = outputs;
    run(call, inputs, reroute_outputs(call, out_tokens, out_scales, out_idx, out_num, out_weight),
        attributes);
    return outputs;
  });
}

void reroute_out(const Tensor& tokens, const Tensor& counts, const Tensor& permute_tokens,
                 const Tensor& permute_per_token_scales, const Tensor& permute_token_idx,
                 const Tensor& expert_token_num, const Tensor& permute_topk_weight,
                 const OptionalTensor& scales, const OptionalTensor& weight,
                 std::int64_t expert_token_num_type, std::int64_t idx_type,
                 OptionalName tokens_dtype, std::int64_t expert_alignment, bool allow_spare_rows) {
  translated([&] {
    // The inputs' views first, then the outputs': the order the fake kernel checks in.
    const Call call(tokens, counts, scales, weight, tokens_dtype);
    const RerouteInputs inputs = call.inputs<RerouteInputs>();
    const RerouteOutputs outputs =
        reroute_outputs(call, permute_tokens, permute_per_token_scales, permute_token_idx,
                        expert_token_num, permute_topk_weight);
    const Attributes attributes =
        attributes_of(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows);
    if (!call.copied.empty()) {
      adapter::check_out_against_copied(infer_reroute(inputs, attributes), outputs, call.copied);
    }
    run(call, inputs, outputs, attributes);
  });
}

Inverse inverse(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                const OptionalTensor& weight, OptionalName tokens_dtype,
                std::int64_t expert_alignment, bool allow_spare_rows) {
  return translated([&] {
    const Call call(tokens, counts, scales, weight, tokens_dtype);
    const InverseInputs inputs = call.inputs<InverseInputs>();
    const Attributes attributes = attributes_of(kExpertTokenNumCount, kIdxGather,
                                                expert_alignment, allow_spare_rows);
    Inverse outputs = call.allocate_outputs<Inverse>(
        adapter::output_specs(infer_inverse(inputs, attributes)), adapter::kInverseStoredLike);
    auto& [out_tokens, out_scales, out_weight] = outputs;
    InverseOutputs views{call.output(out_tokens, "restored_tokens", call.tokens_dtype)};
    if (call.scales) {
      views.restored_per_token_scales =
          call.output(out_scales, "restored_per_token_scales", call.out_scales_dtype());
    }
    if (call.weight) views.restored_topk_weight = call.output(out_weight, "restored_topk_weight");
    run(call, inputs, views, attributes);
    return outputs;
  });
}

// ---- autograd ----

c10::TypedOperatorHandle<decltype(reroute)> forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_re_routing", "")
                             .typed<decltype(reroute)>();
  return op;
}

c10::TypedOperatorHandle<decltype(inverse)> inverse_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_re_routing_inverse", "")
                             .typed<decltype(inverse)>();
  return op;
}

using torch::autograd::Node;
using torch::autograd::variable_list;

// How this torch owns graph nodes: std::shared_ptr (torch 2.9) or
// c10::intrusive_ptr (torch 2.15).
using NodePtr = decltype(torch::autograd::Edge::function);

// A new `T`, owned as NodePtr says: the one place where the two differ here.
template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    // torch's deleter frees a long chain of nodes without deep recursion.
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...),
                              [](T* node) { deleteNode(node); });
  }
}

bool requires_grad(const Tensor& tokens, const OptionalTensor& scales, const OptionalTensor& weight) {
  return at::GradMode::is_enabled() &&
         (tokens.requires_grad() || (scales && scales->requires_grad()) ||
          (weight && weight->requires_grad()));
}

// Zeroes rows [valid, rows) of `gradient`.
void zero_rows_from(Tensor& gradient, const Tensor& valid) {
  const Tensor rows = at::arange(gradient.size(0), gradient.options().dtype(c10::kLong));
  std::vector<std::int64_t> shape(static_cast<std::size_t>(gradient.dim()), 1);
  shape[0] = gradient.size(0);
  gradient.masked_fill_(rows.ge(valid).view(shape), 0);
}

// The graph node of a call to either op, built as torch's own derivative code
// builds its nodes, which torch.func's transforms (grad, vjp, jacrev) take
// where they refuse a C++ torch::autograd::Function. Its edges lead to the
// call's tokens, per_token_scales and expert_topk_weight; its inputs are the
// gradients of the call's outputs, in order. Both ops are reorders by the
// counts, so each one's backward is the other.
class ReorderBackward : public Node {
 public:
  ReorderBackward(const Tensor& counts, const OptionalName& tokens_dtype,
                  std::int64_t expert_alignment, bool allow_spare_rows)
      : counts_(counts, /*is_output=*/false),
        tokens_dtype_(name_of(tokens_dtype)),
        expert_alignment_(expert_alignment),
        allow_spare_rows_(allow_spare_rows) {}

  void release_variables() override { counts_.reset_data(); }

 protected:
  // The call's inputs with gradients: the node's edges, in order.
  enum Input : std::size_t { kTokens, kScales, kWeight };

  // The counts, refused (by torch) where modified in place since the call or
  // freed by an earlier backward.
  Tensor counts() const { return counts_.unpack(); }
  OptionalName tokens_dtype() const {
    return tokens_dtype_ ? OptionalName(*tokens_dtype_) : std::nullopt;
  }

  // The gradient of output `output`: zeros where none came (an output the
  // loss does not use, or one of a dtype without gradients).
  Tensor gradient(const variable_list& grads, std::size_t output) const {
    return grads[output].defined() ? grads[output].contiguous()
                                   : input_metadata(output).zeros_like();
  }
  // The same where `input` takes a gradient; none otherwise.
  OptionalTensor gradient_for(Input input, const variable_list& grads, std::size_t output) const {
    if (!task_should_compute_output(input)) return std::nullopt;
    return gradient(grads, output);
  }

  // The inputs' gradients from the reorder's, undefined where none is asked,
  // with rows [valid, rows) zeroed where `valid` is given: rows the op never
  // read get none.
  variable_list input_gradients(Tensor tokens, Tensor scales, Tensor weight,
                                const std::optional<Tensor>& valid) const {
    variable_list gradients{std::move(tokens), std::move(scales), std::move(weight)};
    for (const Input input : {kTokens, kScales, kWeight}) {
      Tensor& gradient = gradients[input];
      if (!task_should_compute_output(input)) {
        gradient = Tensor();
      } else if (valid) {
        zero_rows_from(gradient, *valid);
      }
    }
    return gradients;
  }

  torch::autograd::SavedVariable counts_;
  std::optional<std::string> tokens_dtype_;
  std::int64_t expert_alignment_;
  bool allow_spare_rows_;
};

// The forward's backward: the inverse reorder of the incoming gradients.
class RerouteBackward final : public ReorderBackward {
 public:
  using ReorderBackward::ReorderBackward;
  std::string name() const override { return "MoeReRoutingBackward"; }

  variable_list apply(variable_list&& grads) override {
    const Tensor counts = this->counts();
    auto [tokens, scales, weight] = inverse_op().call(
        gradient(grads, 0), counts, gradient_for(kScales, grads, 1),
        gradient_for(kWeight, grads, 4), tokens_dtype(), expert_alignment_, allow_spare_rows_);
    // The forward's spare input rows, past the counts' sum.
    return input_gradients(std::move(tokens), std::move(scales), std::move(weight),
                          allow_spare_rows_ ? std::optional<Tensor>(counts.sum()) : std::nullopt);
  }
};

// The inverse's backward: the forward reorder of the incoming gradients.
class InverseBackward final : public ReorderBackward {
 public:
  using ReorderBackward::ReorderBackward;
  std::string name() const override { return "MoeReRoutingInverseBackward"; }

  variable_list apply(variable_list&& grads) override {
    auto [tokens, scales, idx, cumsum, weight] = forward_op().call(
        gradient(grads, 0), counts(), gradient_for(kScales, grads, 1),
        gradient_for(kWeight, grads, 2), kExpertTokenNumCumsum, kIdxGather, tokens_dtype(),
        expert_alignment_, allow_spare_rows_);
    // The inverse's tail input rows, past the last padded segment end
    // (cumsum[-1]): there are some with padding room or spare rows.
    const bool tail = expert_alignment_ > 1 || allow_spare_rows_;
    return input_gradients(std::move(tokens), std::move(scales), std::move(weight),
                           tail ? std::optional<Tensor>(cumsum[-1]) : std::nullopt);
  }
};

// Records `output` as the next of `node`'s inputs and, where its dtype has
// gradients, makes `node` its grad_fn (the index outputs and integer data
// get none).
void set_history(const NodePtr& node, const Tensor& output) {
  const std::uint32_t input_nr = node->add_input_metadata(output);
  if (torch::autograd::isDifferentiableType(output.scalar_type())) {
    torch::autograd::impl::set_gradient_edge(output, {node, input_nr});
  }
}

// Runs `call(tokens, scales, weight)` below the autograd layer and, where an
// input requires grad, makes a `Backward` node (edges to tokens, scales,
// weight) its outputs' grad_fn.
template <typename Backward, typename Call>
auto recorded(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
              const OptionalTensor& weight, const OptionalName& tokens_dtype,
              std::int64_t expert_alignment, bool allow_spare_rows, const Call& call) {
  NodePtr node;
  if (requires_grad(tokens, scales, weight)) {
    node = make_node<Backward>(counts, tokens_dtype, expert_alignment, allow_spare_rows);
    node->set_next_edges(torch::autograd::collect_next_edges(tokens, scales, weight));
  }
  auto outputs = [&] {
    const at::AutoDispatchBelowADInplaceOrView guard;
    return call(tokens, scales, weight);
  }();
  if (node) std::apply([&](const auto&... output) { (set_history(node, output), ...); }, outputs);
  return outputs;
}

// ---- forward-mode AD ----

// Forward-mode AD's one level, as in torch's own derivative code.
constexpr std::uint64_t kForwardLevel = 0;

bool has_tangent(const Tensor& tensor) { return tensor._fw_grad(kForwardLevel).defined(); }
bool has_tangent(const OptionalTensor& tensor) { return tensor && has_tangent(*tensor); }

Tensor primal(const Tensor& tensor) { return tensor._fw_primal(kForwardLevel); }
OptionalTensor primal(const OptionalTensor& tensor) {
  return tensor ? OptionalTensor(primal(*tensor)) : std::nullopt;
}

// What the tangent call reads for an input: its tangent, or the input itself
// (detached) where it has none; that output's tangent is then left unset.
Tensor tangent_or_input(const Tensor& tensor) {
  const Tensor& tangent = tensor._fw_grad(kForwardLevel);
  return tangent.defined() ? tangent : tensor.detach();
}
OptionalTensor tangent_or_input(const OptionalTensor& tensor) {
  return tensor ? OptionalTensor(tangent_or_input(*tensor)) : std::nullopt;
}

void set_tangent(const Tensor& output, const OptionalTensor& input, const Tensor& tangent) {
  if (has_tangent(input)) output._set_fw_grad(tangent, kForwardLevel, /*is_inplace_op=*/false);
}

// Both ops are linear in tokens, scales and weight, so the tangent of each of
// their data outputs (at kTokens, kScales, kWeight) is the same op run on the
// inputs' tangents. `call(tokens, scales, weight)` runs the op; the primal call
// gets the inputs without their tangents, through which backward mode still records.
template <std::size_t kTokens, std::size_t kScales, std::size_t kWeight, typename Call>
auto with_tangents(const Tensor& tokens, const OptionalTensor& scales,
                   const OptionalTensor& weight, const Call& call) {
  auto outputs = call(primal(tokens), primal(scales), primal(weight));
  const auto tangents =
      call(tangent_or_input(tokens), tangent_or_input(scales), tangent_or_input(weight));
  set_tangent(std::get<kTokens>(outputs), tokens, std::get<kTokens>(tangents));
  set_tangent(std::get<kScales>(outputs), scales, std::get<kScales>(tangents));
  set_tangent(std::get<kWeight>(outputs), weight, std::get<kWeight>(tangents));
  return outputs;
}

// The autograd kernels: with no gradient to track they only call the kernel
// below the autograd layer, so an eager no-grad call costs no more than the kernel.
Forward reroute_autograd(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                         const OptionalTensor& weight, std::int64_t expert_token_num_type,
                         std::int64_t idx_type, OptionalName tokens_dtype,
                         std::int64_t expert_alignment, bool allow_spare_rows) {
  const auto call = [&](const Tensor& t, const OptionalTensor& s, const OptionalTensor& w) {
    return forward_op().call(t, counts, s, w, expert_token_num_type, idx_type, tokens_dtype,
                             expert_alignment, allow_spare_rows);
  };
  if (has_tangent(tokens) || has_tangent(scales) || has_tangent(weight)) {
    return with_tangents<0, 1, 4>(tokens, scales, weight, call);
  }
  return recorded<RerouteBackward>(tokens, counts, scales, weight, tokens_dtype, expert_alignment,
                                   allow_spare_rows, call);
}

Inverse inverse_autograd(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                         const OptionalTensor& weight, OptionalName tokens_dtype,
                         std::int64_t expert_alignment, bool allow_spare_rows) {
  const auto call = [&](const Tensor& t, const OptionalTensor& s, const OptionalTensor& w) {
    return inverse_op().call(t, counts, s, w, tokens_dtype, expert_alignment, allow_spare_rows);
  };
  if (has_tangent(tokens) || has_tangent(scales) || has_tangent(weight)) {
    return with_tangents<0, 1, 2>(tokens, scales, weight, call);
  }
  return recorded<InverseBackward>(tokens, counts, scales, weight, tokens_dtype, expert_alignment,
                                   allow_spare_rows, call);
}

c10::TypedOperatorHandle<decltype(reroute_out)> out_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_re_routing_out", "")
                             .typed<decltype(reroute_out)>();
  return op;
}

// The out= op's autograd kernel, boxed: it reads each argument by its schema
// name, and refuses before anything is written
// - an argument that requires grad while grad mode is on, or that has a
//   forward-mode tangent: out= has no derivative, as torch's own out=
//   functions have none (an output that requires grad would also be written
//   behind autograd's back);
// - an output that is an inference tensor: this kernel runs outside
//   inference mode, where torch refuses in-place writes to one (torch's own
//   out= functions refuse it after writing);
// then goes on to the version bump below.
void reroute_out_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const bool grad_mode = at::GradMode::is_enabled();
  const std::vector<c10::Argument>& arguments = op.schema().arguments();
  const auto values = torch::jit::last(*stack, arguments.size());
  for (std::size_t i = 0; i < arguments.size(); ++i) {
    if (!values[i].isTensor()) continue;
    const Tensor& tensor = values[i].toTensor();
    TORCH_CHECK(!grad_mode || !tensor.requires_grad(), arguments[i].name(),
                ": requires grad, but moe_re_routing_out (out=) has no autograd; call "
                "moe_re_routing for gradients, or this under torch.no_grad()");
    TORCH_CHECK_NOT_IMPLEMENTED(!has_tangent(tensor), arguments[i].name(),
                                ": has a forward-mode tangent, but moe_re_routing_out (out=) has "
                                "no derivative; call moe_re_routing for tangents");
    const c10::AliasInfo* alias = arguments[i].alias_info();
    TORCH_CHECK(alias == nullptr || !alias->isWrite() || !tensor.is_inference(),
                arguments[i].name(),
                ": is an inference tensor, which out= writes only under "
                "torch.inference_mode(); pass a clone");
  }
  const at::AutoDispatchBelowAutograd guard;
  op.callBoxed(stack);
}

// The out= op's ADInplaceOrView kernel: bumps the five outputs' version
// counters, as every in-place op does, so that autograd sees the writes.
void reroute_out_inplace(const Tensor& tokens, const Tensor& counts, const Tensor& permute_tokens,
                         const Tensor& permute_per_token_scales, const Tensor& permute_token_idx,
                         const Tensor& expert_token_num, const Tensor& permute_topk_weight,
                         const OptionalTensor& scales, const OptionalTensor& weight,
                         std::int64_t expert_token_num_type, std::int64_t idx_type,
                         OptionalName tokens_dtype, std::int64_t expert_alignment,
                         bool allow_spare_rows) {
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    out_op().call(tokens, counts, permute_tokens, permute_per_token_scales, permute_token_idx,
                  expert_token_num, permute_topk_weight, scales, weight, expert_token_num_type,
                  idx_type, tokens_dtype, expert_alignment, allow_spare_rows);
  }
  for (const Tensor* output : {&permute_tokens, &permute_per_token_scales, &permute_token_idx,
                               &expert_token_num, &permute_topk_weight}) {
    torch::autograd::impl::bump_version(*output);
  }
}

// ---- the Python entry points ----
//
// moe_reroute's public functions call these in eager mode: each calls its
// operator through the dispatcher as torch.ops does (autograd, the CPU and
// CUDA kernels, fake tensors and every mode or transform below Python run
// alike), without the Python frame of torch.ops and its parsing of the
// arguments against the schema, which cost as much as the operator's whole
// gap to an index_select at decode size (docs/torch.md). Arguments that are
// not plainly of the schema's types (a NumPy integer, a missing tensor) get
// NotImplemented back, for the caller to go through torch.ops, whose
// conversions and errors then apply.

namespace py = pybind11;

// `value` as the schema type T, without conversions; nothing where it is not
// plainly a T (a bool or a NumPy integer for an int: torch.ops decides those).
template <typename T>
std::optional<T> plain(py::handle value) {
  PyObject* object = value.ptr();
  if constexpr (std::is_same_v<T, Tensor>) {
    // torch's caster (torch/python.h) takes a torch.Tensor and refuses the rest.
    try {
      return value.cast<Tensor>();
    } catch (const py::cast_error&) {
      return std::nullopt;
    }
  } else if constexpr (std::is_same_v<T, OptionalTensor>) {
    if (value.is_none()) return T{};
    std::optional<Tensor> tensor = plain<Tensor>(value);
    if (!tensor) return std::nullopt;
    return T{std::move(*tensor)};
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    if (!PyLong_CheckExact(object)) return std::nullopt;
    int overflow = 0;
    const long long number = PyLong_AsLongLongAndOverflow(object, &overflow);
    if (overflow != 0) return std::nullopt;
    return number;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!PyBool_Check(object)) return std::nullopt;
    return object == Py_True;
  } else {
    static_assert(std::is_same_v<T, OptionalName>);
    if (value.is_none()) return T{};
    Py_ssize_t size = 0;
    const char* text = PyUnicode_Check(object) ? PyUnicode_AsUTF8AndSize(object, &size) : nullptr;
    if (text == nullptr) {
      PyErr_Clear();
      return std::nullopt;
    }
    return T{c10::string_view(text, static_cast<std::size_t>(size))};
  }
}

// `body()`, run with the GIL released; the GIL is held again when it returns.
template <typename Body>
auto without_gil(const Body& body) {
  const py::gil_scoped_release no_gil;
  return body();
}

// Calls `op` on `args` converted as plain(), with the GIL released as
// torch.ops releases it; NotImplemented where an argument is not plain.
template <typename Result, typename... Params, std::size_t... I>
py::object call_plain(const c10::TypedOperatorHandle<Result(Params...)>& op,
                      const py::args& args, std::index_sequence<I...>) {
  const auto not_implemented = [] { return py::reinterpret_borrow<py::object>(Py_NotImplemented); };
  if (args.size() != sizeof...(Params)) return not_implemented();
  std::tuple<std::optional<std::decay_t<Params>>...> values{
      plain<std::decay_t<Params>>(args[I])...};
  if (!(std::get<I>(values) && ...)) return not_implemented();
  const auto call = [&] { return op.call(*std::get<I>(values)...); };
  if constexpr (std::is_void_v<Result>) {
    without_gil(call);
    return py::none();
  } else {
    return py::cast(without_gil(call));
  }
}

template <typename Result, typename... Params>
py::object call_plain(const c10::TypedOperatorHandle<Result(Params...)>& op,
                      const py::args& args) {
  return call_plain(op, args, std::index_sequence_for<Params...>{});
}

// ---- the CUDA status word from Python ----

/// Reads and clears every device's status word (one host sync each) and
/// raises ValueError naming the argument when bad counts were seen since the
/// last check.
void cuda_check() {
#if MOE_REROUTE_HAS_CUDA
  translated([] {
    std::vector<Tensor> words;
    {
      std::lock_guard<std::mutex> lock(status_mutex);
      words = status_words;
    }
    for (const Tensor& word : words) {
      if (word.defined() && cuda::stream_is_capturing(current_stream(word.device()))) {
        fail(ErrorCode::kBackend,
             "cuda_check: reads the status words (a host sync), which cannot happen under CUDA "
             "graph capture; call it after the capture");
      }
    }
    for (const Tensor& word : words) {
      if (word.defined()) check_status(word);
    }
  });
#endif
}

/// Sets the CUDA status check ("deferred" or "sync") and returns the previous one.
std::string set_cuda_status_check(c10::string_view mode) {
  return translated([&] {
    if (mode != "deferred" && mode != "sync") {
      fail(ErrorCode::kInvalidArgument,
           "mode: must be \"deferred\" or \"sync\"; got \"" + std::string(mode) + "\"");
    }
    return std::string(sync_mode.exchange(mode == "sync") ? "sync" : "deferred");
  });
}

// ---- the CPU output cache from Python ----

/// Sets the most bytes of freed CPU outputs kept for reuse and returns the
/// previous limit.
std::int64_t set_cpu_output_cache_limit(std::int64_t limit_bytes) {
  return translated([&] {
    if (limit_bytes < 0) {
      fail(ErrorCode::kInvalidArgument,
           "limit_bytes: must be >= 0 (0 keeps none), got " + std::to_string(limit_bytes));
    }
    return set_output_cache_limit(limit_bytes);
  });
}

/// The bytes of freed CPU outputs kept for reuse now.
std::int64_t cpu_output_cache_bytes() { return output_cache_bytes(); }

constexpr const char* kAttributes =
    "Tensor? per_token_scales=None, Tensor? expert_topk_weight=None, "
    "int expert_token_num_type=1, int idx_type=0, str? tokens_dtype=None, "
    "int expert_alignment=1, bool allow_spare_rows=False";

// `head`, the attributes, then `tail`: a whole schema.
std::string schema(const char* head, const char* tail) {
  return std::string(head) + kAttributes + tail;
}

}  // namespace
}  // namespace moe_reroute::torch_ops

namespace ops = moe_reroute::torch_ops;

TORCH_LIBRARY(moe_reroute, m) {
  m.set_python_module("moe_reroute._torch");
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  m.def(ops::schema("moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, ",
                    ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
            .c_str(),
        tags);
  m.def(ops::schema("moe_re_routing_out(Tensor tokens, Tensor expert_token_num_per_rank, "
               "Tensor(a!) permute_tokens, Tensor(b!) permute_per_token_scales, "
               "Tensor(c!) permute_token_idx, Tensor(d!) expert_token_num, "
               "Tensor(e!) permute_topk_weight, ",
               ") -> ()")
            .c_str(),
        tags);
  m.def(
      "moe_re_routing_inverse(Tensor tokens, Tensor expert_token_num_per_rank, "
      "Tensor? per_token_scales=None, Tensor? expert_topk_weight=None, str? tokens_dtype=None, "
      "int expert_alignment=1, bool allow_spare_rows=False) -> (Tensor, Tensor, Tensor)",
      tags);
  m.def("cuda_check() -> ()", &ops::cuda_check);
  m.def("set_cuda_status_check(str mode) -> str", &ops::set_cuda_status_check);
  m.def("set_cpu_output_cache_limit(int limit_bytes) -> int", &ops::set_cpu_output_cache_limit);
  m.def("cpu_output_cache_bytes() -> int", &ops::cpu_output_cache_bytes);
}

TORCH_LIBRARY_IMPL(moe_reroute, CPU, m) {
  m.impl("moe_re_routing", &ops::reroute);
  m.impl("moe_re_routing_out", &ops::reroute_out);
  m.impl("moe_re_routing_inverse", &ops::inverse);
}

TORCH_LIBRARY_IMPL(moe_reroute, CUDA, m) {
  m.impl("moe_re_routing", &ops::reroute);
  m.impl("moe_re_routing_out", &ops::reroute_out);
  m.impl("moe_re_routing_inverse", &ops::inverse);
}

TORCH_LIBRARY_IMPL(moe_reroute, Autograd, m) {
  m.impl("moe_re_routing", &ops::reroute_autograd);
  m.impl("moe_re_routing_inverse", &ops::inverse_autograd);
  m.impl("moe_re_routing_out",
         torch::CppFunction::makeFromBoxedFunction<&ops::reroute_out_autograd>());
}

TORCH_LIBRARY_IMPL(moe_reroute, ADInplaceOrView, m) {
  m.impl("moe_re_routing_out", &ops::reroute_out_inplace);
}

// Python imports this library as moe_reroute._torch_ops: the registrations
// above run as it loads, and these are its functions.
PYBIND11_MODULE(_torch_ops, m) {
  using pybind11::args;
  m.doc() = "Eager entry points of the moe_reroute operators (moe_reroute._torch).";
  m.def("forward", [](const args& a) { return ops::call_plain(ops::forward_op(), a); });
  m.def("forward_out", [](const args& a) { return ops::call_plain(ops::out_op(), a); });
  m.def("inverse", [](const args& a) { return ops::call_plain(ops::inverse_op(), a); });
}
