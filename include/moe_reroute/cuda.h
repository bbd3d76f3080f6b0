#pragma once

/// The CUDA backend: the same operator on device memory (static shapes of
/// docs/spec.md section 9 included), launched on the caller's stream with no
/// host synchronisation, allocation or device-memory read, so it can be
/// captured in a CUDA graph: one kernel launch a call up to N x E = 8192
/// blocks (two past it). Offsets are computed on the device from the
/// device-resident counts; rules 4 and 5 of docs/spec.md section 4 (counts
/// non-negative, summing to A, or to at most A with allow_spare_rows) are
/// therefore not thrown but reported in a device status word, and when they
/// fail no output but the status word is written.
///
/// Shapes, dtypes, attributes, output specs, overlap and alignment are
/// validated on the host exactly as for the CPU backend, and throw Error
/// before anything is launched; a CUDA runtime failure throws Error with
/// ErrorCode::kBackend. This header needs no CUDA header: the stream is
/// passed as a `void*` holding a cudaStream_t.

#include <cstddef>
#include <cstdint>
#include <string>

#include "moe_reroute/cuda_export.h"
#include "moe_reroute/reroute.h"
#include "moe_reroute/routing.h"

namespace moe_reroute::cuda {

/// Bits of the device status word. The word is sticky: a call whose counts,
/// ids or row indices are bad ORs its bits in, a good call leaves it as it
/// was, no call clears it; the caller zeroes it once and reads (and clears)
/// it when it chooses.
enum StatusBit : std::int32_t {
  kStatusNegativeCount = 1,  // some count[r][e] < 0 (rule 4)
  // The counts do not sum to A (sum past A with allow_spare_rows), or a count
  // or the sum passes A or overflows (rule 5).
  kStatusCountSumMismatch = 2,
  // moe_init_routing: some expert_idx value is outside [0, expert_num) (rule 12.7).
  kStatusExpertIdOutOfRange = 4,
  // moe_finalize_routing: some expanded_row_idx value is below -1, -1 with
  // drop_pad_mode 0 or 2, or at or past E * C with 1 or 3 (rule 13.8).
  kStatusRowIndexOutOfRange = 8,
  // moe_finalize_routing with bias: some expert_idx value is not a row of bias (rule 13.8).
  kStatusBiasRowOutOfRange = 16,
};

/// Where a call runs and what device memory it may use.
/// The stream's device runs the call, whichever device is current (it is
/// current during the call and the caller's comes back after), except while
/// the stream is being captured: CUDA cannot be asked a capturing stream's
/// device without invalidating the capture, so the current device must then
/// be the stream's (as a device guard makes it); else the launch fails with
/// ErrorCode::kBackend.
struct DeviceContext {
  void* stream = nullptr;  // a cudaStream_t; nullptr is the legacy default stream
  std::int32_t* status = nullptr;  // device int32, 4-byte aligned, sticky (see StatusBit)
  void* workspace = nullptr;       // device memory, 8-byte aligned; may be null when none is needed
  // At least required_workspace_bytes(N, E), or the routing operators' *_workspace_bytes.
  std::size_t workspace_bytes = 0;
};

/// Device workspace bytes a call with counts of shape [num_ranks, num_experts]
/// needs: 0 when the call is one launch (N x E <= 8192 blocks whose int32
/// tables fit 99 KiB of shared memory, which any E <= 640 does), else the
/// tables the two launches share.
MOE_REROUTE_CUDA_API std::size_t required_workspace_bytes(std::int64_t num_ranks,
                                                          std::int64_t num_experts);

/// The forward operator on device views (same specs as the CPU
/// moe_reroute::moe_re_routing, from infer_reroute). Counts, permute_token_idx
/// and expert_token_num must be aligned to their element size; tokens, scales
/// and weights may have any alignment. Throws Error on the host before
/// launching anything.
MOE_REROUTE_CUDA_API void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                                         const Attributes& attributes,
                                         const DeviceContext& context);

/// The inverse operator on device views (same specs as the CPU
/// moe_reroute::moe_re_routing_inverse). Throws Error before launching anything.
MOE_REROUTE_CUDA_API void moe_re_routing_inverse(const InverseInputs& inputs,
                                                 const InverseOutputs& outputs,
                                                 const Attributes& attributes,
                                                 const DeviceContext& context);

/// Device workspace bytes of moe_init_routing for these inputs' shapes and
/// dtypes and `attributes` (no data is read): the ids' histogram per chunk
/// of positions and the source row of each row of expanded_x. Throws Error
/// as moe_init_routing does for a bad shape, dtype or attribute.
MOE_REROUTE_CUDA_API std::size_t init_routing_workspace_bytes(
    const InitRoutingInputs& inputs, const InitRoutingAttributes& attributes = {});

/// Device workspace bytes of moe_finalize_routing for these inputs' shapes
/// and `attributes`: the call's flag of bad row indices. Throws Error as
/// moe_finalize_routing does for a bad shape, dtype or attribute.
MOE_REROUTE_CUDA_API std::size_t finalize_routing_workspace_bytes(
    const FinalizeRoutingInputs& inputs, const FinalizeRoutingAttributes& attributes = {});

/// moe_init_routing (docs/spec.md section 12) on device views, with the
/// CPU's specs (infer_init_routing); expert_num must be >= 1 here (it bounds
/// the histogram of the ids). The ids are checked on the device: an id
/// outside [0, expert_num) sets kStatusExpertIdOutOfRange and no output is
/// written. expert_idx and the int32 outputs must be aligned to their
/// element size; x and expanded_x may have any alignment. Throws Error on the
/// host before launching anything.
MOE_REROUTE_CUDA_API void moe_init_routing(const InitRoutingInputs& inputs,
                                           const InitRoutingOutputs& outputs,
                                           const InitRoutingAttributes& attributes,
                                           const DeviceContext& context);

/// moe_finalize_routing (docs/spec.md section 13) on device views, with the
/// CPU's spec (infer_finalize_routing) and its float32 arithmetic bit for
/// bit. The row indices and, with bias, the ids are checked on the device:
/// kStatusRowIndexOutOfRange or kStatusBiasRowOutOfRange, and out is not
/// written. Every view must be aligned to its element size. Throws Error on
/// the host before launching anything.
MOE_REROUTE_CUDA_API void moe_finalize_routing(const FinalizeRoutingInputs& inputs,
                                               const FinalizeRoutingOutputs& outputs,
                                               const FinalizeRoutingAttributes& attributes,
                                               const DeviceContext& context);

/// Whether `stream` (a cudaStream_t; nullptr is the legacy default stream) is
/// being captured into a CUDA graph now, for callers that allocate or read
/// device memory around a call (the torch operators' status word). Throws
/// Error with ErrorCode::kBackend where CUDA cannot tell (no usable device).
MOE_REROUTE_CUDA_API bool stream_is_capturing(void* stream);

/// The message for a non-zero status word, naming the argument, e.g.
/// "expert_token_num_per_rank: some count is negative"; "" for 0.
MOE_REROUTE_CUDA_API std::string status_message(std::int32_t status);

}  // namespace moe_reroute::cuda
