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

// How an op's operands and results relate to the rows of dim 0 (overlap.h): a row result's row i
// depends only on row i of the row operands (and on the other operands whole); a summed result
// is a sum over the rows (run_op leaves an undefined one out, so a caller can compute the row
// results block by block and the summed ones once over all rows). Ops with neither (losses, or
// none listed) are not row-wise.
struct RowRoles {
  bool row_wise = false;
  std::vector<bool> row_inputs, row_outputs, summed_outputs;  // per op.inputs / op.outputs
};
RowRoles row_roles(const ProgramOp& op);

}  // namespace meshfuse::detail
