// One op of a Program run on tensors (internal to exec): what a Compute step of a Plan calls.
#pragma once

#include <vector>

#include "meshfuse/core/stream.h"
#include "meshfuse/core/tensor.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/program.h"

namespace meshfuse::detail {

// Runs op's kernel on `inputs` (op.inputs' order; undefined views for absent operands) into
// `outputs` (op.outputs' order, allocated by the caller in the results' shapes and dtypes). Any
// scratch the kernel needs is allocated on the outputs' device, on `stream`.
void run_op(const ProgramOp& op, const std::vector<TensorView>& inputs,
            const std::vector<TensorView>& outputs, const Stream& stream);

// A collective op (a Compute step with a mesh_dim): the vocabulary-parallel cross_entropy forward
// or fused_linear_cross_entropy, on this rank's part of the vocabulary, with `team` the ranks
// holding the others.
void run_collective_op(const ProgramOp& op, const std::vector<TensorView>& inputs,
                       const std::vector<TensorView>& outputs, Communicator& team,
                       const Stream& stream);

}  // namespace meshfuse::detail
