// The MultiDeviceExecutor checks shared by the local (threads) and the gloo / mpi (processes)
// tests. Every rank of a 4-rank team calls the same function; each checks its own part against
// the single-device result, which every rank computes whole (the same program built without a
// mesh).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/autodiff.h"
#include "meshfuse/exec/executor.h"
#include "test_util.h"

namespace meshfuse::test::exec {

// Every input whole, the same on every rank (seeded by its position): labels in [0, 29) with
// every third row ignored, floats normal with std 0.5.
inline std::vector<Tensor> whole_inputs(const Program& p) {
  std::vector<Tensor> inputs;
  for (std::size_t i = 0; i < p.inputs().size(); ++i) {
    const ValueInfo& info = p.info(p.inputs()[i]);
    if (info.dtype == DType::I32 || info.dtype == DType::I64) {
      inputs.push_back(make_labels(info.shape[0], 29, info.dtype, 100 + i));
    } else {
      inputs.push_back(randn(info.shape, info.dtype, 100 + i, 0.5));
    }
  }
  return inputs;
}

inline std::vector<Placement> placements_of(const Program& p, Value in) {
  std::vector<Placement> pl = p.placements(in);
  if (pl.empty()) pl.assign(static_cast<std::size_t>(p.mesh()->ndim()), Replicate{});
  return pl;
}

inline std::vector<TensorView> views(const std::vector<Tensor>& tensors) {
  return {tensors.begin(), tensors.end()};
}

// Runs build(true) (on a mesh) on this rank and build(false) (the same ops, no mesh) whole,
// gathers each output and compares it with the whole one within `tol`; a second run must be
// bitwise equal. Returns the executor's plan text.
inline std::string expect_matches_single_device(const std::function<Program(bool)>& build,
                                                const std::shared_ptr<Communicator>& comm,
                                                double tol,
                                                const MultiDeviceExecutorParams& params = {}) {
  const Program sharded = build(true), single = build(false);
  const std::vector<Tensor> whole = whole_inputs(single);
  const std::vector<Tensor> expected = MultiDeviceExecutor(single, comm).run(views(whole));

  std::vector<Tensor> parts;
  for (std::size_t i = 0; i < whole.size(); ++i)
    parts.push_back(shard_tensor(whole[i], *sharded.mesh(),
                                 placements_of(sharded, sharded.inputs()[i]), comm->rank()));
  MultiDeviceExecutor executor(sharded, comm, params);
  const std::vector<Tensor> out = executor.run(views(parts));
  const std::vector<Tensor> again = executor.run(views(parts));
  const Plan& plan = executor.plan();
  EXPECT_EQ(out.size(), expected.size());
  for (std::size_t i = 0; i < out.size() && i < expected.size(); ++i) {
    const PlanValue& v = plan.values[static_cast<std::size_t>(plan.outputs[i])];
    EXPECT_EQ(out[i].shape(), v.shape) << "output " << i;
    EXPECT_EQ(values(out[i]), values(again[i])) << "output " << i << " differs run to run";
    const Tensor gathered =
        gather_tensor(out[i], expected[i].shape(), *sharded.mesh(), v.placements, comm);
    expect_close(gathered, expected[i], tol,
                 "output " + std::to_string(i) + " on rank " + std::to_string(comm->rank()));
  }
  return plan.to_string();
}

inline DeviceMesh line(const Communicator& comm) { return DeviceMesh::of_shape({comm.size()}); }

// Every transition of one mesh dimension, on extents the team divides and does not (3 rows over
// 4 ranks leave one empty). Integer values: gathers are exact, and a Partial input whose rank r
// term is (r + 1) times the tensor sums exactly to n (n + 1) / 2 times it.
inline void check_every_transition(const std::shared_ptr<Communicator>& comm) {
  const int n = comm->size(), rank = comm->rank();
  const std::vector<Placement> kinds = {Shard{0}, Shard{1}, Replicate{}, Partial{}};
  for (const Shape& shape : {Shape{8, 12}, Shape{10, 7}, Shape{3, 5}}) {
    Tensor whole(shape, DType::F32);
    for (std::int64_t i = 0; i < whole.numel(); ++i)
      whole.data_ptr<float>()[i] = static_cast<float>((i * 7) % 13 - 6);
    for (const Placement& from : kinds)
      for (const Placement& to : kinds) {
        if (std::holds_alternative<Partial>(to)) continue;
        const std::string what = to_string(from) + " -> " + to_string(to) + " of " +
                                 shape_str(shape) + " on rank " + std::to_string(rank);
        Program p;
        const Value t = p.define_tensor("t", shape, DType::F32);
        p.set_mesh(line(*comm));
        p.set_placements(t, {from});
        p.add_output(t, {to});
        Tensor part, sum = whole;
        if (std::holds_alternative<Partial>(from)) {
          part = Tensor(shape, DType::F32);
          sum = Tensor(shape, DType::F32);
          for (std::int64_t i = 0; i < whole.numel(); ++i) {
            part.data_ptr<float>()[i] = whole.data_ptr<float>()[i] * static_cast<float>(rank + 1);
            sum.data_ptr<float>()[i] =
                whole.data_ptr<float>()[i] * static_cast<float>(n * (n + 1) / 2);
          }
        } else {
          part = shard_tensor(whole, p.mesh().value(), {from}, rank);
        }
        MultiDeviceExecutor executor(p, comm);
        const std::vector<Tensor> out = executor.run({part});
        ASSERT_EQ(out.size(), 1u) << what;
        EXPECT_EQ(values(out[0]), values(shard_tensor(sum, p.mesh().value(), {to}, rank))) << what;
        const Plan& plan = executor.plan();
        const bool communicates = !(from == to) && !std::holds_alternative<Replicate>(from);
        EXPECT_EQ(plan.steps.size(), from == to ? 0u : 1u) << what << "\n" << plan.to_string();
        if (communicates && plan.steps.size() == 1) {
          const auto* c = std::get_if<Communication>(&plan.steps[0]);
          ASSERT_NE(c, nullptr) << what;
          EXPECT_EQ(c->backend, comm->backend()) << what;
        }
      }
  }
}

// A llama-style MLP block, tensor- and sequence-parallel (Megatron-LM's layout) on a 1-D mesh:
// x Shard(0) on tokens, gate and up column-parallel, down row-parallel, residual added, y back on
// tokens. 10 tokens and 22 intermediate features over 4 ranks are both uneven.
inline Program mlp_block(bool sharded, const DeviceMesh& mesh, DType dtype = DType::F32) {
  const std::int64_t tokens = 10, hidden = 16, inter = 22;
  Program p;
  const Value x = p.define_tensor("x", {tokens, hidden}, dtype);
  const Value norm = p.define_tensor("norm_weight", {hidden}, dtype);
  const Value gate = p.define_tensor("gate_weight", {inter, hidden}, dtype);
  const Value up = p.define_tensor("up_weight", {inter, hidden}, dtype);
  const Value down = p.define_tensor("down_weight", {hidden, inter}, dtype);
  const Value h = p.rmsnorm(x, norm, 1e-5);
  const Value a = p.swiglu(p.linear(h, gate), p.linear(h, up));
  const Value y = p.add(x, p.linear(a, down));
  if (!sharded) {
    p.add_output(y);
    return p;
  }
  p.set_mesh(mesh);
  // The tensor-parallel dimension is the last one; any before it are data-parallel, over tokens.
  const auto on = [&](Placement tensor_parallel, Placement data_parallel) {
    std::vector<Placement> pl(static_cast<std::size_t>(mesh.ndim()), data_parallel);
    pl.back() = tensor_parallel;
    return pl;
  };
  p.set_placements(x, on(Shard{0}, Shard{0}));
  p.set_placements(gate, on(Shard{0}, Replicate{}));
  p.set_placements(up, on(Shard{0}, Replicate{}));
  p.set_placements(down, on(Shard{1}, Replicate{}));
  p.add_output(y, on(Shard{0}, Shard{0}));
  return p;
}

inline void check_mlp_block(const std::shared_ptr<Communicator>& comm) {
  const std::string plan = expect_matches_single_device(
      [&](bool sharded) { return mlp_block(sharded, line(*comm)); }, comm, 2e-5);
  const std::string on = " on " + std::string(to_string(comm->backend()));
  EXPECT_NE(plan.find("all_gather(dim 0)" + on), std::string::npos) << plan;
  EXPECT_NE(plan.find("reduce_scatter(sum, dim 0)" + on), std::string::npos) << plan;
  EXPECT_EQ(plan.find("all_reduce"), std::string::npos) << plan;
}

// The same block on a 2 x 2 mesh (data x tensor): tokens split over both dimensions.
inline void check_mlp_block_on_a_2d_mesh(const std::shared_ptr<Communicator>& comm) {
  if (comm->size() != 4) GTEST_SKIP() << "written for 4 ranks";
  expect_matches_single_device(
      [&](bool sharded) {
        return mlp_block(sharded, DeviceMesh::of_shape({2, 2}));
      },
      comm, 2e-5);
}

// The head without a fused op: logits column-parallel (the vocabulary split) and Megatron-LM's
// vocabulary-parallel cross_entropy on them (mean, with label smoothing and z-loss: the row
// statistics all-gathered and combined), and the fused linear cross-entropy on token rows with the
// weight replicated (none: per-row losses on token shards).
inline void check_head(const std::shared_ptr<Communicator>& comm) {
  const auto build = [&](bool sharded) {
    const std::int64_t tokens = 10, hidden = 16, vocab = 29;
    Program p;
    const Value x = p.define_tensor("x", {tokens, hidden}, DType::F32);
    const Value w = p.define_tensor("head_weight", {vocab, hidden}, DType::F32);
    const Value labels = p.define_tensor("labels", {tokens}, DType::I64);
    const Value logits = p.linear(x, w);
    CrossEntropyOptions mean;
    mean.label_smoothing = 0.1;
    mean.z_loss_scale = 1e-4;
    CrossEntropyOptions none;
    none.reduction = Reduction::None;
    p.add_output(p.cross_entropy(logits, labels, mean));
    p.add_output(p.fused_linear_cross_entropy(x, w, {}, labels, none));
    if (sharded) {
      p.set_mesh(line(*comm));
      p.set_placements(w, {Shard{0}});
      p.set_placements(labels, {Shard{0}});
    }
    return p;
  };
  const std::string plan = expect_matches_single_device(build, comm, 2e-5);
  EXPECT_NE(plan.find("= cross_entropy("), std::string::npos) << plan;
  EXPECT_NE(plan.find("with all_gather of its row statistics on " +
                      std::string(to_string(comm->backend()))),
            std::string::npos)
      << plan;
  EXPECT_EQ(plan.find("all_to_all"), std::string::npos) << plan;
}

// The joint program of `p` for the gradient of its first output with respect to every floating
// input.
inline Program with_grad(const Program& p) {
  std::vector<Value> wrt;
  for (Value in : p.inputs())
    if (is_floating_point(p.info(in).dtype)) wrt.push_back(in);
  return grad(p, p.outputs()[0], wrt);
}

// The MLP block's forward and backward, on a line of ranks and on a 2 x 2 (data x tensor) mesh,
// where the weights' gradients are also summed over the data-parallel dimension.
inline void check_mlp_block_backward(const std::shared_ptr<Communicator>& comm) {
  const std::string plan = expect_matches_single_device(
      [&](bool sharded) { return with_grad(mlp_block(sharded, line(*comm))); }, comm, 5e-5);
  // x's gradient goes back to token shards and the norm weight's is summed over them.
  EXPECT_NE(plan.find("all_reduce(sum)"), std::string::npos) << plan;
  if (comm->size() == 4)
    expect_matches_single_device(
        [&](bool sharded) {
          return with_grad(mlp_block(sharded, DeviceMesh::of_shape({2, 2})));
        },
        comm, 5e-5);
}

// The head's losses and their gradients: rmsnorm then the fused linear cross-entropy on token rows
// (sum), and a column-parallel linear then the vocabulary-parallel cross_entropy (mean), whose
// backward runs on each rank's columns without communication.
inline void check_head_backward(const std::shared_ptr<Communicator>& comm) {
  for (const bool fused : {true, false}) {
    const auto build = [&](bool sharded) {
      const std::int64_t tokens = 10, hidden = 16, vocab = 29;
      Program p;
      const Value x = p.define_tensor("x", {tokens, hidden}, DType::F32);
      const Value norm = p.define_tensor("norm_weight", {hidden}, DType::F32);
      const Value w = p.define_tensor("head_weight", {vocab, hidden}, DType::F32);
      const Value labels = p.define_tensor("labels", {tokens}, DType::I64);
      CrossEntropyOptions sum;
      sum.reduction = Reduction::Sum;
      CrossEntropyOptions mean;
      mean.label_smoothing = 0.1;
      const Value h = p.rmsnorm(x, norm, 1e-5);
      p.add_output(fused ? p.fused_linear_cross_entropy(h, w, {}, labels, sum)
                         : p.cross_entropy(p.linear(h, w), labels, mean));
      if (sharded) {
        p.set_mesh(line(*comm));
        p.set_placements(x, {Shard{0}});
        p.set_placements(w, {Shard{0}});
        p.set_placements(labels, {Shard{0}});
      }
      return with_grad(p);
    };
    const std::string plan = expect_matches_single_device(build, comm, 5e-5);
    if (!fused) {
      EXPECT_NE(plan.find("cross_entropy_backward("), std::string::npos) << plan;
    }
  }
}

// The MLP block forward and backward with its communications on `backend`, whatever the
// communicator's own (a team of the same ranks on that backend: Communicator::with_backends).
inline void check_backend_parameter(const std::shared_ptr<Communicator>& comm,
                                    CommunicatorBackend backend) {
  MultiDeviceExecutorParams params;
  params.lowering.communicator_backend = backend;
  const std::string plan = expect_matches_single_device(
      [&](bool sharded) { return with_grad(mlp_block(sharded, line(*comm))); }, comm, 5e-5, params);
  EXPECT_NE(plan.find("communications on " + std::string(to_string(backend))), std::string::npos)
      << plan;
  EXPECT_NE(plan.find("reduce_scatter(sum, dim 0) on " + std::string(to_string(backend))),
            std::string::npos)
      << plan;
}

// Errors every rank sees alike: a rank outside the mesh, a placement with no rule, an input of the
// wrong shape, and ranks running different programs (the communicator's metadata check).
inline void check_errors(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->size() - 1;
  Program small;
  const Value t = small.define_tensor("t", {6, 4}, DType::F32);
  small.set_mesh(DeviceMesh({0}));
  small.add_output(t);
  expect_error([&] { MultiDeviceExecutor(small, comm); }, ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor", "laid over"});
  expect_error([&] { lower(small, rank + 5, CommunicatorBackend::Local); },
               ErrorCode::InvalidArgument, {"rank", "outside"});

  Program no_rule;
  const Value u = no_rule.define_tensor("u", {6, 4}, DType::F32);
  no_rule.set_mesh(line(*comm));
  no_rule.set_placements(u, {Shard{0}});
  no_rule.add_output(u, {Partial{}});
  expect_error([&] { MultiDeviceExecutor(no_rule, comm).plan(); }, ErrorCode::InvalidArgument,
               {"'u'", "[Shard(0)]", "Partial"});

  Program p;
  const Value x = p.define_tensor("x", {comm->rank() == 0 ? 10 : 12, 4}, DType::F32);
  p.set_mesh(line(*comm));
  p.set_placements(x, {Shard{0}});
  p.add_output(x, {Replicate{}});
  MultiDeviceExecutor executor(p, comm);
  const Shape part = executor.plan().values[0].shape;
  expect_error(
      [&] {
        executor.run({Tensor({part[0] + 1, 4}, DType::F32)});
      },
      ErrorCode::ShapeMismatch, {"'x'", shape_str(part)});
  // Rank 0 gathers 10 rows, the others 12: every rank gets the mismatch, none hangs.
  expect_error([&] { executor.run({Tensor(part, DType::F32)}); }, ErrorCode::InvalidArgument,
               {"all_gather", "disagree"});
}

}  // namespace meshfuse::test::exec
