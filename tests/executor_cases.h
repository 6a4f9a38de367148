// The MultiDeviceExecutor checks shared by the local (threads) and the gloo / mpi (processes)
// tests. Every rank of a 4-rank team calls the same function; each checks its own part against
// the single-device result, which every rank computes whole (the same program built without a
// mesh).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshfuse/distributed/communicator.h"
#include "meshfuse/exec/autodiff.h"
#include "meshfuse/exec/executor.h"
#include "test_util.h"

namespace meshfuse::test::exec {

// Every input whole, the same on every rank (seeded by its position): labels in [0, V), V the
// rows of the input "head_weight" (29 without one), with every third row ignored (every row, with
// ignore_every_label), floats normal with std 0.5.
inline std::vector<Tensor> whole_inputs(const Program& p, bool ignore_every_label = false) {
  std::int64_t classes = 29;
  for (const Value in : p.inputs())
    if (p.info(in).name == "head_weight") classes = p.info(in).shape[0];
  std::vector<Tensor> inputs;
  for (std::size_t i = 0; i < p.inputs().size(); ++i) {
    const ValueInfo& info = p.info(p.inputs()[i]);
    if (info.dtype == DType::I32 || info.dtype == DType::I64) {
      inputs.push_back(ignore_every_label
                           ? full(info.shape, info.dtype, -100)
                           : make_labels(info.shape[0], classes, info.dtype, 100 + i));
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

// This rank's parts of `whole` (the inputs of `p` whole, in order), as p's placements lay them.
inline std::vector<Tensor> parts_of(const Program& p, const std::vector<Tensor>& whole, int rank) {
  std::vector<Tensor> parts;
  for (std::size_t i = 0; i < whole.size(); ++i)
    parts.push_back(shard_tensor(whole[i], *p.mesh(), placements_of(p, p.inputs()[i]), rank));
  return parts;
}

inline std::vector<TensorView> views(const std::vector<Tensor>& tensors) {
  return {tensors.begin(), tensors.end()};
}

// The 16-bit check: max |actual - expected| <= tol x max(max |expected|, floor), with non-finite
// values in the same places (max_abs_err skips them).
inline void expect_normwise_close(const TensorView& actual, const TensorView& expected, double tol,
                                  const std::string& what, double floor = 0) {
  const testing::Diff d = testing::compare(actual, expected, 0, 0);
  const testing::Diff scale =
      testing::compare(expected, Tensor::zeros(expected.shape(), expected.dtype()), 0, 0);
  EXPECT_LE(d.max_abs_err, tol * std::max(scale.max_abs_err, floor)) << what;
  EXPECT_EQ(d.mismatched_nonfinite, 0) << what;
}

// Runs build(true) (on a mesh) on this rank and build(false) (the same ops, no mesh) whole,
// gathers each output and compares it with the whole one: elementwise within `tol` (absolute and
// relative), or, for 16-bit programs (`normwise`), max |sharded - whole| <= tol max |whole|. A
// second run must be bitwise equal. Returns the executor's plan text.
inline std::string expect_matches_single_device(const std::function<Program(bool)>& build,
                                                const std::shared_ptr<Communicator>& comm,
                                                double tol,
                                                const MultiDeviceExecutorParams& params = {},
                                                bool ignore_every_label = false,
                                                bool normwise = false) {
  const Program sharded = build(true), single = build(false);
  const std::vector<Tensor> whole = whole_inputs(single, ignore_every_label);
  const std::vector<Tensor> expected = MultiDeviceExecutor(single, comm).run(views(whole));

  const std::vector<Tensor> parts = parts_of(sharded, whole, comm->rank());
  MultiDeviceExecutor executor(sharded, comm, params);
  const std::vector<Tensor> out = executor.run(views(parts));
  const std::vector<Tensor> again = executor.run(views(parts));
  const Plan& plan = executor.plan();
  EXPECT_EQ(out.size(), expected.size());
  for (std::size_t i = 0; i < out.size() && i < expected.size(); ++i) {
    const PlanValue& v = plan.values[static_cast<std::size_t>(plan.outputs[i])];
    EXPECT_EQ(out[i].shape(), v.shape) << "output " << i;
    EXPECT_TRUE(testing::bitwise_equal(out[i], again[i]))
        << "output " << i << " differs run to run";
    const Tensor gathered =
        gather_tensor(out[i], expected[i].shape(), *sharded.mesh(), v.placements, comm);
    const std::string what =
        "output " + std::to_string(i) + " on rank " + std::to_string(comm->rank());
    if (!normwise) {
      expect_close(gathered, expected[i], tol, what);
      continue;
    }
    expect_normwise_close(gathered, expected[i], tol, what);
  }
  return plan.to_string();
}

inline DeviceMesh line(const Communicator& comm) { return DeviceMesh::of_shape({comm.size()}); }

// A Partial output checked by its reduction: the terms gathered and reduced give `whole`.
inline void expect_terms_of(const Tensor& term, const Tensor& whole, const DeviceMesh& mesh,
                            const std::vector<Placement>& placements,
                            const std::shared_ptr<Communicator>& comm, const std::string& what) {
  EXPECT_EQ(values(gather_tensor(term, whole.shape(), mesh, placements, comm)), values(whole))
      << what;
}

// Every transition of one mesh dimension, on extents the team divides and does not (3 rows over
// 4 ranks leave one empty). Integer values: gathers are exact, and a Partial input whose rank r
// term is (r + 1) times the tensor sums exactly to n (n + 1) / 2 times it. A Partial output is
// made without communication from a Replicate, or from a shard of a sum or product (padded with
// the identity); a shard of a max is gathered first, a Partial of another op all-reduced.
inline void check_every_transition(const std::shared_ptr<Communicator>& comm) {
  const int n = comm->size(), rank = comm->rank();
  const std::vector<Placement> kinds = {Shard{0}, Shard{1}, Replicate{}, Partial{}};
  std::vector<Placement> targets = kinds;
  for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod, ReduceOp::Avg})
    targets.push_back(Partial{op});
  for (const Shape& shape : {Shape{8, 12}, Shape{10, 7}, Shape{3, 5}}) {
    Tensor whole(shape, DType::F32);
    for (std::int64_t i = 0; i < whole.numel(); ++i)
      whole.data_ptr<float>()[i] = static_cast<float>((i * 7) % 13 - 6);
    for (const Placement& from : kinds)
      for (const Placement& to : targets) {
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
        const Plan& plan = executor.plan();
        if (const auto* partial = std::get_if<Partial>(&to)) {
          expect_terms_of(out[0], sum, p.mesh().value(), {to}, comm, what);
          const bool local = std::holds_alternative<Replicate>(from) ||
                             (std::holds_alternative<Shard>(from) && partial_identity(partial->op));
          EXPECT_EQ(plan.steps.size(), from == to ? 0u
                                       : local    ? 1u
                                                  : 2u)
              << what << "\n"
              << plan.to_string();
          if (!(from == to)) {
            EXPECT_TRUE(std::holds_alternative<Partition>(plan.steps.back()));
          }
          continue;
        }
        EXPECT_EQ(values(out[0]), values(shard_tensor(sum, p.mesh().value(), {to}, rank))) << what;
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

// Every transition between placements of a 2 x 2 mesh, nested shards of one tensor dimension
// included (an outer mesh dimension that changes how it shards a dim changes what the inner
// shards of it mean). Integer values, Partial terms as in check_every_transition, per mesh
// dimension of Partial: their sum over the mesh is the tensor times 3 per Partial dimension.
// Partial outputs (sum, max and prod, in every mix that commutes) are checked by their reduction.
inline void check_every_transition_on_a_2d_mesh(const std::shared_ptr<Communicator>& comm) {
  if (comm->size() != 4) GTEST_SKIP() << "written for 4 ranks";
  const int rank = comm->rank();
  const DeviceMesh mesh = DeviceMesh::of_shape({2, 2});
  const std::vector<std::int64_t> at = mesh.coordinates(rank);
  const std::vector<Placement> kinds = {Shard{0}, Shard{1}, Replicate{}, Partial{}};
  std::vector<Placement> targets = kinds;
  targets.push_back(Partial{ReduceOp::Max});
  targets.push_back(Partial{ReduceOp::Prod});
  const Shape shape{10, 7};
  Tensor whole(shape, DType::F32);
  for (std::int64_t i = 0; i < whole.numel(); ++i)
    whole.data_ptr<float>()[i] = static_cast<float>((i * 7) % 13 - 6);
  for (const Placement& a : kinds)
    for (const Placement& b : kinds)
      for (const Placement& c : targets)
        for (const Placement& d : targets) {
          const std::vector<Placement> from{a, b}, to{c, d};
          if (!partials_commute(to)) continue;
          // fmt, not operator+: GCC 12 warns (-Wrestrict) on a chain of string concatenations.
          const std::string what = fmt::format("[{}, {}] -> [{}, {}] on rank {}", to_string(a),
                                               to_string(b), to_string(c), to_string(d), rank);
          Program p;
          const Value t = p.define_tensor("t", shape, DType::F32);
          p.set_mesh(mesh);
          p.set_placements(t, from);
          p.add_output(t, to);
          // This rank's input: its part as the non-Partial placements say, times (coordinate
          // + 1) along each Partial dimension; the whole is the tensor times 3 per such dimension.
          std::vector<Placement> parts = from;
          float factor = 1, total = 1;
          for (std::size_t m = 0; m < 2; ++m)
            if (std::holds_alternative<Partial>(from[m])) {
              parts[m] = Replicate{};
              factor *= static_cast<float>(at[m] + 1);
              total *= 3;
            }
          Tensor part = shard_tensor(whole, mesh, parts, rank), sum(shape, DType::F32);
          for (std::int64_t i = 0; i < part.numel(); ++i) part.data_ptr<float>()[i] *= factor;
          for (std::int64_t i = 0; i < sum.numel(); ++i)
            sum.data_ptr<float>()[i] = whole.data_ptr<float>()[i] * total;
          MultiDeviceExecutor executor(p, comm);
          const std::vector<Tensor> out = executor.run({part});
          ASSERT_EQ(out.size(), 1u) << what;
          if (std::holds_alternative<Partial>(c) || std::holds_alternative<Partial>(d))
            expect_terms_of(out[0], sum, mesh, to, comm, what + "\n" + executor.plan().to_string());
          else
            EXPECT_EQ(values(out[0]), values(shard_tensor(sum, mesh, to, rank)))
                << what << "\n"
                << executor.plan().to_string();
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
// `vocab` below the team's size leaves some ranks a shard of no columns.
inline void check_head(const std::shared_ptr<Communicator>& comm, std::int64_t vocab = 29) {
  const auto build = [&](bool sharded) {
    const std::int64_t tokens = 10, hidden = 16;
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
inline void check_head_backward(const std::shared_ptr<Communicator>& comm,
                                std::int64_t vocab = 29) {
  for (const bool fused : {true, false}) {
    const auto build = [&](bool sharded) {
      const std::int64_t tokens = 10, hidden = 16;
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

// The head's fused linear cross-entropy on 1100 tokens (more than the CPU's 512-row chunk) with
// a bias, label smoothing and z-loss, its loss in f32; on `mesh` (when given) the weight and bias
// sharded over the vocabulary: the vocabulary-parallel form.
inline Program fused_loss_program(DType dtype, Reduction reduction, bool backward,
                                  const std::optional<DeviceMesh>& mesh) {
  const std::int64_t tokens = 1100, hidden = 8, vocab = 29;
  Program p;
  const Value x = p.define_tensor("x", {tokens, hidden}, dtype);
  const Value w = p.define_tensor("head_weight", {vocab, hidden}, dtype);
  const Value b = p.define_tensor("head_bias", {vocab}, dtype);
  const Value labels = p.define_tensor("labels", {tokens}, DType::I64);
  CrossEntropyOptions o;
  o.label_smoothing = 0.1;
  o.z_loss_scale = 1e-3;
  o.reduction = reduction;
  p.add_output(p.fused_linear_cross_entropy(x, w, b, labels, o, DType::F32));
  if (mesh) {
    p.set_mesh(*mesh);
    p.set_placements(w, {Shard{0}});
    p.set_placements(b, {Shard{0}});
  }
  return backward ? with_grad(p) : p;
}

// The vocabulary-parallel fused linear cross-entropy on its own (the plan's only collective is
// inside the op): several chunks of rows, mean, forward + backward; then the same with every
// label ignored. In bf16, per-row fp32 losses within 1e-4 of the one-device kernel's, which takes
// the logits in fp32 (rounding each chunk's logits to bf16, as this op once did, was off by 1e-3
// to 1e-1), and the gradients normwise within a few bf16 roundings.
inline void check_vocabulary_parallel_fused_loss(const std::shared_ptr<Communicator>& comm) {
  const auto build = [&](DType dtype, Reduction reduction, bool backward, bool sharded) {
    return fused_loss_program(dtype, reduction, backward,
                              sharded ? std::optional<DeviceMesh>(line(*comm)) : std::nullopt);
  };
  for (const bool all_ignored : {false, true}) {
    const std::string plan = expect_matches_single_device(
        [&](bool sharded) { return build(DType::F32, Reduction::Mean, true, sharded); }, comm, 5e-5,
        {}, all_ignored);
    EXPECT_NE(plan.find("fused_linear_cross_entropy("), std::string::npos) << plan;
    EXPECT_NE(plan.find("with all_gather of its row statistics"), std::string::npos) << plan;
    EXPECT_EQ(plan.find("all_gather(dim 0)"), std::string::npos) << plan;  // x stays whole
  }
  for (const bool backward : {false, true}) {
    const std::string plan = expect_matches_single_device(
        [&](bool sharded) {
          return build(DType::BF16, backward ? Reduction::Mean : Reduction::None, backward,
                       sharded);
        },
        comm, backward ? 2e-2 : 1e-4, {}, false, backward);
    EXPECT_NE(plan.find("with all_gather of its row statistics"), std::string::npos) << plan;
  }
}

// Executors on one 2 x 2 mesh communicate on the communicator's kept mesh_teams: a second
// executor adds records to the same teams' histories instead of splitting new ones (each split
// sets up new connections and store keys).
inline void check_executors_share_mesh_teams(const std::shared_ptr<Communicator>& comm) {
  if (comm->size() != 4) GTEST_SKIP() << "written for 4 ranks";
  const DeviceMesh mesh = DeviceMesh::of_shape({2, 2});
  Program p;
  const Value t = p.define_tensor("t", {6, 4}, DType::F32);
  p.set_mesh(mesh);
  p.set_placements(t, {Shard{0}, Shard{1}});
  p.add_output(t, {Replicate{}, Replicate{}});
  const auto teams = comm->mesh_teams(mesh);
  for (const auto& team : teams) team->set_history_size(64);
  const auto records = [&] { return teams[0]->history().size() + teams[1]->history().size(); };
  Tensor whole({6, 4}, DType::F32);
  for (std::int64_t i = 0; i < whole.numel(); ++i) whole.data_ptr<float>()[i] = float(i);
  const Tensor part = shard_tensor(whole, mesh, {Shard{0}, Shard{1}}, comm->rank());
  std::size_t before = records();
  for (int i = 0; i < 2; ++i) {
    MultiDeviceExecutor executor(p, comm);
    EXPECT_EQ(values(executor.run({part})[0]), values(whole)) << "executor " << i;
    EXPECT_GT(records(), before) << "executor " << i << " communicated on other teams";
    before = records();
  }
  EXPECT_EQ(comm->mesh_teams(mesh), teams);
}

// The vocabulary split over both dimensions of a 2 x 2 mesh: the loss combines over one, so the
// lowering gathers the head along the other (it used to refuse the program; each dimension chose
// the vocabulary-parallel loss on its own).
inline void check_vocabulary_on_two_mesh_dimensions(const std::shared_ptr<Communicator>& comm) {
  if (comm->size() != 4) GTEST_SKIP() << "written for 4 ranks";
  const auto build = [&](bool sharded) {
    Program p;
    const Value x = p.define_tensor("x", {6, 8}, DType::F32);
    const Value w = p.define_tensor("head_weight", {29, 8}, DType::F32);
    const Value labels = p.define_tensor("labels", {6}, DType::I64);
    p.add_output(p.fused_linear_cross_entropy(x, w, {}, labels));
    if (sharded) {
      p.set_mesh(DeviceMesh::of_shape({2, 2}));
      p.set_placements(w, {Shard{0}, Shard{0}});
    }
    return with_grad(p);
  };
  const std::string plan = expect_matches_single_device(build, comm, 5e-5);
  EXPECT_NE(plan.find("with all_gather of its row statistics"), std::string::npos) << plan;
}

// The MLP block in bf16, forward and backward: Partial terms are rounded to bf16 before they are
// summed (the single-device program sums in fp32 inside one GEMM), and a weight's gradient summed
// over token shards can cancel, so the check is normwise: 2e-2 of the output's largest value
// (meshfuse run's bf16 tolerance), a few bf16 roundings of it.
inline void check_mlp_block_bf16(const std::shared_ptr<Communicator>& comm) {
  expect_matches_single_device(
      [&](bool sharded) { return with_grad(mlp_block(sharded, line(*comm), DType::BF16)); }, comm,
      2e-2, {}, false, true);
}

// Communication overlapped with the GEMMs (overlap.h): the MLP block forward and backward with
// overlap = collective at chunks 1, 2, the team size and 8, and ring, against one device within
// the GEMMs' tolerance and bitwise equal run to run (10 tokens over 4 ranks are uneven parts, and
// 8 chunks of them leave empty pieces); in bf16 normwise.
inline void check_mlp_block_overlap(const std::shared_ptr<Communicator>& comm) {
  const auto block = [&](DType dtype) {
    return [&comm, dtype](bool sharded) {
      return with_grad(mlp_block(sharded, line(*comm), dtype));
    };
  };
  for (const Overlap form : {Overlap::Collective, Overlap::Ring})
    for (const int chunks : {1, 2, 0, 8}) {
      if (form == Overlap::Ring && chunks != 0) continue;
      MultiDeviceExecutorParams params;
      params.overlap.overlap = form;
      params.overlap.chunks = chunks;
      SCOPED_TRACE(fmt::format("overlap {}, chunks {}", to_string(form), chunks));
      expect_matches_single_device(block(DType::F32), comm, 5e-5, params);
      expect_matches_single_device(block(DType::BF16), comm, 2e-2, params, false, true);
      const std::vector<OverlapSegment> segments = find_overlap_segments(
          MultiDeviceExecutor(block(DType::F32)(true), comm).plan(), params.overlap);
      // The forward's all_gather .. reduce_scatter, and the backward's all_gather of the upstream
      // gradient (which comes as y's rows, Shard(0), as y is output) .. reduce_scatter; a ring
      // splits each after the gathered tensor's last reader.
      ASSERT_EQ(segments.size(), form == Overlap::Ring ? 4u : 2u);
      const OverlapSegment &forward = segments[0], &backward = segments.back();
      EXPECT_GE(forward.gather, 0) << forward.to_string();
      EXPECT_EQ(forward.scatter >= 0, form == Overlap::Collective) << forward.to_string();
      EXPECT_EQ(backward.gather >= 0, form == Overlap::Collective) << backward.to_string();
      EXPECT_GE(backward.scatter, 0) << backward.to_string();
      for (const OverlapSegment& s : segments)
        EXPECT_EQ(s.chunks, form == Overlap::Ring || chunks == 0 ? comm->size() : chunks);
    }
  MultiDeviceExecutorParams bad;
  bad.overlap.chunks = -1;
  expect_error([&] { MultiDeviceExecutor(block(DType::F32)(true), comm, bad).plan(); },
               ErrorCode::InvalidArgument, {"chunks", "-1"});
}

// Overlap's edges: a lone row-parallel GEMM + reduce_scatter is a stretch; a ring stretch whose
// reduce_scatter input is computed before the gathered tensor's last reader keeps its
// reduce_scatter whole; a softmax over a 1-D tensor (its rows are its one dim) and a batched
// matmul are not chunked; one token over the team (one rank holds it, the others none) gives the
// same stretches on every rank, also profiled (a barrier per communication). Each against one
// device, in every form.
inline void check_overlap_edges(const std::shared_ptr<Communicator>& comm) {
  const auto gemm_rs = [&](bool sharded) {
    Program p;
    const Value x = p.define_tensor("x", {10, 12}, DType::F32);
    const Value w = p.define_tensor("w", {8, 12}, DType::F32);
    const Value y = p.linear(x, w);
    if (!sharded) {
      p.add_output(y);
      return p;
    }
    p.set_mesh(line(*comm));
    p.set_placements(x, {Shard{1}});
    p.set_placements(w, {Shard{1}});
    p.add_output(y, {Shard{0}});
    return p;
  };
  // The down projection's input comes before up's linear, the last reader of the gathered h.
  const auto early_partial = [&](bool sharded) {
    Program p;
    const Value x = p.define_tensor("x", {10, 16}, DType::F32);
    const Value gate = p.define_tensor("gate_weight", {22, 16}, DType::F32);
    const Value up = p.define_tensor("up_weight", {22, 16}, DType::F32);
    const Value down = p.define_tensor("down_weight", {16, 22}, DType::F32);
    const Value partial = p.linear(p.linear(x, gate), down);
    const Value b = p.linear(x, up);
    p.add_output(p.add(x, partial));
    p.add_output(p.swiglu(b, b));
    if (sharded) {
      p.set_mesh(line(*comm));
      p.set_placements(x, {Shard{0}});
      p.set_placements(gate, {Shard{0}});
      p.set_placements(up, {Shard{0}});
      p.set_placements(down, {Shard{1}});
    }
    return p;
  };
  const auto softmax_1d = [&](bool sharded) {
    Program p;
    const Value x = p.define_tensor("x", {8}, DType::F32);
    const Value y = p.softmax(x);
    if (!sharded) {
      p.add_output(y);
      return p;
    }
    p.set_mesh(line(*comm));
    p.set_placements(x, {Shard{0}});
    p.add_output(y, {Replicate{}});
    return p;
  };
  const auto one_token = [&](bool sharded) {
    Program p;
    const Value x = p.define_tensor("x", {1, 16}, DType::F32);
    const Value gate = p.define_tensor("gate_weight", {22, 16}, DType::F32);
    const Value down = p.define_tensor("down_weight", {16, 22}, DType::F32);
    const Value h = p.linear(x, gate);
    const Value y = p.add(x, p.add(p.linear(h, down), p.linear(h, down)));
    if (!sharded) {
      p.add_output(y);
      return p;
    }
    p.set_mesh(line(*comm));
    p.set_placements(x, {Shard{0}});
    p.set_placements(gate, {Shard{0}});
    p.set_placements(down, {Shard{1}});
    p.add_output(y, {Shard{0}});
    return p;
  };
  for (const Overlap form : {Overlap::Collective, Overlap::Ring}) {
    SCOPED_TRACE(fmt::format("overlap {}", to_string(form)));
    MultiDeviceExecutorParams params;
    params.overlap.overlap = form;
    const auto segments = [&](const std::function<Program(bool)>& build) {
      return find_overlap_segments(MultiDeviceExecutor(build(true), comm).plan(), params.overlap);
    };
    expect_matches_single_device(gemm_rs, comm, 1e-5, params);
    const std::vector<OverlapSegment> lone = segments(gemm_rs);
    ASSERT_EQ(lone.size(), 1u);
    EXPECT_LT(lone[0].gather, 0);
    EXPECT_GE(lone[0].scatter, 0);

    expect_matches_single_device(early_partial, comm, 2e-5, params);
    for (const OverlapSegment& seg : segments(early_partial))
      EXPECT_TRUE(form == Overlap::Collective || seg.scatter < 0) << seg.to_string();

    expect_matches_single_device(softmax_1d, comm, 1e-6, params);
    EXPECT_TRUE(segments(softmax_1d).empty());

    params.profile = true;
    expect_matches_single_device(one_token, comm, 2e-5, params);
  }
}

// Errors every rank sees alike: a rank outside the mesh, an input of the wrong shape, a stream of
// another device, and ranks running different programs (the communicator's metadata check).
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
  expect_error(
      [&] {
        executor.run({Tensor(part, DType::F32), Tensor(part, DType::F32)});
      },
      ErrorCode::InvalidArgument,
      {"MultiDeviceExecutor.run: 2 inputs given, the program takes 1, in this order: "
       "%0 'x' " +
       shape_str({comm->rank() == 0 ? 10 : 12, 4}) + " f32"});
  // Refused before the ranks compare their programs, which would run on the stream.
  expect_error(
      [&] {
        executor.run({Tensor(part, DType::F32)}, Stream{Device{DeviceType::CUDA, 0}});
      },
      ErrorCode::DeviceMismatch,
      {"MultiDeviceExecutor.run on rank", "the stream is on cuda:0 but the inputs are on cpu"});
  expect_error(
      [&] {
        gather_tensor(Tensor({part[0] + 1, 4}, DType::F32), {10, 4}, line(*comm), {Shard{0}}, comm);
      },
      ErrorCode::ShapeMismatch,
      {"gather_tensor: 'local' on rank", "part of a [10, 4] tensor placed as [Shard(0)]",
       "got " + shape_str({part[0] + 1, 4})});
  // Rank 0's tensor has 10 rows, the others' 12: every rank sees the programs differ, none hangs,
  // and each names the line where rank 1's program parts from rank 0's.
  expect_error([&] { executor.run({Tensor(part, DType::F32)}); }, ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor", "rank 1 runs another program than rank 0",
                "its line 2 is `%0 'x' [12, 4] f32 [Shard(0)]` where rank 0's is `%0 'x' [10, 4] "
                "f32 [Shard(0)]`"});

  // The same program with rank 0 alone asking for ring overlap: its sends would never meet the
  // others' all_gather (a timeout on every rank); the params are compared with the program.
  MultiDeviceExecutorParams ring;
  if (comm->rank() == 0) ring.overlap.overlap = Overlap::Ring;
  const Program same = mlp_block(true, line(*comm));
  const std::vector<Tensor> parts = parts_of(same, whole_inputs(same), comm->rank());
  expect_error([&] { MultiDeviceExecutor(same, comm, ring).run(views(parts)); },
               ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor", "rank 1 has other executor params than rank 0",
                "overlap none", "where rank 0 has backend the communicator's, overlap ring"});
  // Rank 0 alone naming another backend: the ranks compare on the communicator's own, so all
  // meet and fail together (rank 0 went on to set up the other backend's team, and the others
  // waited for it in the comparison until the timeout).
  MultiDeviceExecutorParams other;
  const bool local = comm->backend(DeviceType::CPU) == CommunicatorBackend::Local;
  if (comm->rank() == 0)
    other.lowering.communicator_backend =
        local ? CommunicatorBackend::Gloo : CommunicatorBackend::Local;
  expect_error([&] { MultiDeviceExecutor(same, comm, other).run(views(parts)); },
               ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor", "rank 1 has other executor params than rank 0",
                "backend the communicator's",
                local ? "where rank 0 has backend gloo" : "where rank 0 has backend local"});
  // The same after a first run: set_params() that changes them makes the ranks compare again (they
  // once went their own ways, each waiting in its own collective for the timeout); every rank
  // setting the same params runs on.
  MultiDeviceExecutor again(same, comm);
  const std::vector<Tensor> first = again.run(views(parts));
  MultiDeviceExecutorParams everyone;
  everyone.profile = true;
  again.set_params(everyone);
  EXPECT_EQ(values(again.run(views(parts))[0]), values(first[0]));
  again.set_params(ring);
  expect_error([&] { again.run(views(parts)); }, ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor", "rank 1 has other executor params than rank 0"});
  // Rank 0 alone changing its params while the others set theirs unchanged: all compare again.
  MultiDeviceExecutor third(same, comm);
  third.run(views(parts));
  MultiDeviceExecutorParams streams;
  if (comm->rank() == 0) streams.overlap.number_of_streams = 3;
  third.set_params(streams);
  expect_error([&] { third.run(views(parts)); }, ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor", "rank 1 has other executor params than rank 0", "streams 2",
                "where rank 0 has", "streams 3"});
}

}  // namespace meshfuse::test::exec
