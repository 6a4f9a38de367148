// Reverse mode over a Program: grad() gives the joint program, the forward ops followed by the
// backward ops (each op's backward kernel), which lowers and runs like any program. Placements
// need nothing more: the lowering gives each backward op the transposed communications (the
// gradient of an all-gathered value is reduce-scattered back to its shards, a replicated weight
// used by sharded compute gets a Partial gradient that is all-reduced).
#pragma once

#include <vector>

#include "meshfuse/exec/program.h"

namespace meshfuse {

// The joint program of `program` for the gradients of `loss` with respect to `wrt`:
//   inputs   program's inputs, then "grad_loss" (loss's shape and dtype: the upstream gradient,
//            1 for a loss that ends the computation); on a mesh placed as the loss is output
//            when it was given placements (e.g. per-token losses as Shard(0); Partial(sum)
//            made Replicate; a loss output twice: its first output's), else Replicate
//   outputs  program's outputs, then the gradient of each of `wrt` in order, placed as that
//            input is (Replicate when not set, and where it is Partial: the gradient of a sum's
//            every term is the whole gradient); inputs with the same gradient (an add's operands)
//            get one output each
// Gradients of a value used several times are summed (add). fused_linear_cross_entropy computes
// its gradients in its forward, so it takes grad_loss there; its loss must then be `loss` itself.
// rmsnorm's and cross_entropy's backward read the rstd and lse their forward saved.
// Errors: InvalidArgument (loss not a floating value of the program, an empty wrt, a wrt that is
// not a floating input or is listed twice, a wrt the loss does not depend on, an input already named
// "grad_loss"), Unsupported (a fused_linear_cross_entropy whose loss is not `loss`, a
// fused_residual_add_rmsnorm whose y is unused while r is used, a wrt or a loss placed Partial
// with a reduction other than sum).
Program grad(const Program& program, Value loss, const std::vector<Value>& wrt);

}  // namespace meshfuse
