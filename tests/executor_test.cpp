// MultiDeviceExecutor on the local backend (4 ranks as threads) and what needs no team: lowering
// without a mesh, the plan cache, shard_tensor. The same cases run on gloo and mpi processes in
// dist_process_main.cpp.
#include "meshfuse/exec/executor.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "executor_cases.h"
#include "meshfuse/core/memory.h"
#include "meshfuse/distributed/store.h"
#include "meshfuse/ops/fused_linear_cross_entropy.h"
#include "meshfuse/ops/rmsnorm.h"
#include "test_util.h"

namespace meshfuse::test {
namespace {

using namespace std::chrono_literals;

// fn on 4 ranks as threads of a LocalWorld; a failing rank stops the others in seconds.
void on_four_ranks(const std::function<void(const std::shared_ptr<Communicator>&)>& fn) {
  CommOptions options;
  options.timeout = 20s;
  run_local(4, fn, options);
}

TEST(Executor, ANullCommunicatorIsAnError) {  // it was dereferenced while the mesh was set up
  Program p;
  p.add_output(p.define_tensor("t", {2}, DType::F32));
  expect_error([&] { MultiDeviceExecutor(p, nullptr); }, ErrorCode::InvalidArgument,
               {"MultiDeviceExecutor: communicator is null"});
}

TEST(ExecutorLocal, EveryTransitionOfOneMeshDimensionGivesTheParts) {
  on_four_ranks(exec::check_every_transition);
}

TEST(ExecutorLocal, TensorAndSequenceParallelMlpBlockMatchesOneDevice) {
  on_four_ranks(exec::check_mlp_block);
}

TEST(ExecutorLocal, MlpBlockOnATwoByTwoMeshMatchesOneDevice) {
  on_four_ranks(exec::check_mlp_block_on_a_2d_mesh);
}

TEST(ExecutorLocal, VocabularyParallelHeadMatchesOneDevice) {
  on_four_ranks([](const std::shared_ptr<Communicator>& comm) { exec::check_head(comm); });
}

TEST(ExecutorLocal, MlpBlockBackwardMatchesOneDeviceOnALineAndATwoByTwoMesh) {
  on_four_ranks(exec::check_mlp_block_backward);
}

TEST(ExecutorLocal, HeadBackwardMatchesOneDevice) {
  on_four_ranks([](const std::shared_ptr<Communicator>& comm) { exec::check_head_backward(comm); });
}

// A vocabulary of 3 over 4 ranks: one shard has no columns, whose -inf statistics made every
// rank's loss NaN.
TEST(ExecutorLocal, AVocabularySmallerThanTheTeamMatchesOneDevice) {
  on_four_ranks([](const std::shared_ptr<Communicator>& comm) {
    exec::check_head(comm, 3);
    exec::check_head_backward(comm, 3);
  });
}

TEST(ExecutorLocal, EveryTransitionOfATwoByTwoMeshGivesTheParts) {
  on_four_ranks(exec::check_every_transition_on_a_2d_mesh);
}

TEST(ExecutorLocal, ExecutorsOnOneMeshShareTheCommunicatorsMeshTeams) {
  on_four_ranks(exec::check_executors_share_mesh_teams);
}

TEST(ExecutorLocal, VocabularyParallelFusedLossOverSeveralChunksMatchesOneDevice) {
  on_four_ranks(exec::check_vocabulary_parallel_fused_loss);
}

TEST(ExecutorLocal, AVocabularySplitOverTwoMeshDimensionsIsGatheredAlongOneAndMatchesOneDevice) {
  on_four_ranks(exec::check_vocabulary_on_two_mesh_dimensions);
}

TEST(ExecutorLocal, MlpBlockInBf16MatchesOneDeviceWithinBf16Rounding) {
  on_four_ranks(exec::check_mlp_block_bf16);
}

TEST(ExecutorLocal, OverlappedMlpBlockMatchesOneDeviceInEveryForm) {
  on_four_ranks(exec::check_mlp_block_overlap);
}

TEST(ExecutorLocal, OverlapEdgesMatchOneDevice) { on_four_ranks(exec::check_overlap_edges); }

TEST(ExecutorLocal, ErrorsAreTheSameOnEveryRankAndNothingHangs) {
  on_four_ranks(exec::check_errors);
}

// CUDA: a one-rank NCCL mesh runs the MLP block forward and backward on the GPU (every transition
// of the plan a one-rank NCCL collective) and matches the same program on the CPU.
TEST(ExecutorCuda, OneRankNcclMeshRunsTheMlpBlockForwardAndBackward) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!communicator_backend_built(CommunicatorBackend::Nccl)) GTEST_SKIP() << "no nccl backend";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("meshfuse_executor_cuda_" + std::to_string(getpid()));
  CommOptions options;  // the FileStore makes the directory, private
  options.backend = "cuda:nccl";
  options.timeout = 20s;
  const auto comm =
      init_communicator(LaunchInfo{}, std::make_shared<FileStore>(dir.string()), options);
  const Program sharded = exec::with_grad(exec::mlp_block(true, DeviceMesh({0})));
  const Program single = exec::with_grad(exec::mlp_block(false, DeviceMesh({0})));
  const std::vector<Tensor> whole = exec::whole_inputs(single);
  LocalWorld cpu_world(1);
  const std::vector<Tensor> expected =
      MultiDeviceExecutor(single, cpu_world.communicator(0)).run(exec::views(whole));
  const CudaStream stream(0);
  std::vector<Tensor> on_gpu;
  for (const Tensor& t : whole) on_gpu.push_back(on(t, kCuda, stream));
  MultiDeviceExecutor executor(sharded, comm);
  const std::vector<Tensor> out = executor.run(exec::views(on_gpu), stream);
  const Plan& plan = executor.plan(DeviceType::CUDA);
  EXPECT_EQ(plan.backend, CommunicatorBackend::Nccl);
  EXPECT_NE(plan.to_string().find("all_gather(dim 0) on nccl"), std::string::npos)
      << plan.to_string();
  ASSERT_EQ(out.size(), expected.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].device(), kCuda);
    expect_close(to_cpu(out[i], stream), expected[i], 5e-5, "output " + std::to_string(i));
  }
  std::filesystem::remove_all(dir);
}

// The vocabulary-parallel fused loss allocates one chunk of logits at a time (in bf16 with
// gradients, fp32 logits and their gradient's bf16 rounding in 2/3 of the one-device kernel's
// rows), also where the rank holds the whole vocabulary (a one-rank team): at llama-3's vocabulary
// the chunk is a quarter of the rows, so a whole-rows scratch is four times the bound.
TEST(ExecutorCuda, VocabularyParallelFusedLossScratchIsOneChunkOnAOneRankTeam) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!communicator_backend_built(CommunicatorBackend::Nccl)) GTEST_SKIP() << "no nccl backend";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("meshfuse_executor_vpm_" + std::to_string(getpid()));
  CommOptions options;  // the FileStore makes the directory, private
  options.backend = "cuda:nccl";
  options.timeout = 20s;
  const auto comm =
      init_communicator(LaunchInfo{}, std::make_shared<FileStore>(dir.string()), options);
  constexpr std::int64_t tokens = 8192, hidden = 64, vocab = 128256;
  Program p;
  const Value x = p.define_tensor("x", {tokens, hidden}, DType::BF16);
  const Value w = p.define_tensor("head_weight", {vocab, hidden}, DType::BF16);
  const Value labels = p.define_tensor("labels", {tokens}, DType::I64);
  const Value loss = p.fused_linear_cross_entropy(x, w, {}, labels, {}, DType::F32);
  p.add_output(loss);
  p.set_mesh(DeviceMesh({0}));
  p.set_placements(w, {Shard{0}});
  const Program joint = grad(p, loss, {x, w});
  const CudaStream stream(0);
  std::vector<Tensor> inputs;
  for (Value in : joint.inputs()) {
    const ValueInfo& info = joint.info(in);
    Tensor host(info.shape, info.dtype);
    if (info.name == "labels") {
      testing::fill_uniform_int(host, 1, 0, vocab);
    } else if (info.name == "grad_loss") {
      fill(host, 1.0);
    } else {
      testing::fill_normal(host, 2, 0.0, 0.05);
    }
    inputs.push_back(on(host, kCuda, stream));
  }
  MultiDeviceExecutor executor(joint, comm);
  synchronize(stream);
  const std::int64_t before = device_memory_stats(kCuda).allocated;
  reset_peak_memory_stats(kCuda);
  std::int64_t output_bytes = 0;
  {
    const std::vector<Tensor> out = executor.run(exec::views(inputs), stream);
    synchronize(stream);
    for (const Tensor& t : out)
      output_bytes += t.numel() * static_cast<std::int64_t>(element_size(t.dtype()));
    EXPECT_TRUE(std::isfinite(values(to_cpu(out[0], stream))[0]));
  }
  const std::int64_t chunk = fused_linear_cross_entropy_chunk_rows(DeviceType::CUDA, vocab);
  ASSERT_LT(chunk, tokens);
  const std::int64_t scratch = device_memory_stats(kCuda).peak_allocated - before - output_bytes;
  EXPECT_LE(scratch, chunk * vocab * 4 + (std::int64_t{16} << 20))
      << "chunk " << chunk << " rows of " << tokens;
  std::filesystem::remove_all(dir);
}

// Overlap on CUDA: 2 and 4 ranks as threads on GPU 0 (the local backend, each rank its own
// stream), the MLP block forward and backward in f32 and bf16 with overlap collective (chunks 1, 2,
// the team size, 8) and ring against overlap none on the same GPU, and bitwise run to run; none
// itself against the one-device program on the CPU.
TEST(ExecutorCuda, OverlappedMlpBlockOnLocalRanksMatchesNoOverlap) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const int ranks : {2, 4})
    for (const DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(fmt::format("{} ranks, {}", ranks, to_string(dtype)));
      const Program single = exec::with_grad(exec::mlp_block(false, DeviceMesh({0}), dtype));
      const std::vector<Tensor> whole = exec::whole_inputs(single);
      LocalWorld one(1);
      const std::vector<Tensor> expected =
          MultiDeviceExecutor(single, one.communicator(0)).run(exec::views(whole));
      const double tol = dtype == DType::F32 ? 5e-5 : 2e-2;
      CommOptions options;
      options.timeout = 20s;
      run_local(
          ranks,
          [&](const std::shared_ptr<Communicator>& comm) {
            const CudaStream stream(0);
            const Program sharded =
                exec::with_grad(exec::mlp_block(true, exec::line(*comm), dtype));
            std::vector<Tensor> parts;
            for (std::size_t i = 0; i < whole.size(); ++i)
              parts.push_back(on(shard_tensor(whole[i], *sharded.mesh(),
                                              exec::placements_of(sharded, sharded.inputs()[i]),
                                              comm->rank()),
                                 kCuda, stream));
            MultiDeviceExecutor plain(sharded, comm);
            const std::vector<Tensor> base = plain.run(exec::views(parts), stream);
            const Plan& plan = plain.plan(DeviceType::CUDA);
            for (std::size_t i = 0; i < base.size(); ++i) {
              const PlanValue& v = plan.values[static_cast<std::size_t>(plan.outputs[i])];
              const Tensor gathered = to_cpu(
                  gather_tensor(base[i], expected[i].shape(), *sharded.mesh(), v.placements, comm,
                                stream),
                  stream);
              exec::expect_normwise_close(gathered, expected[i], tol, "output " + std::to_string(i),
                                          1.0);
            }
            // Streams 1 and 3 too, and set_params changing them on one executor.
            MultiDeviceExecutor executor(sharded, comm);
            for (const Overlap form : {Overlap::Collective, Overlap::Ring})
              for (const int chunks : {1, 2, 0, 8})
                for (const int streams : {2, 1, 3}) {
                if ((form == Overlap::Ring || chunks != 2) && streams != 2) continue;
                if (form == Overlap::Ring && chunks != 0) continue;
                MultiDeviceExecutorParams params;
                params.overlap = {form, chunks, streams};
                executor.set_params(params);
                const std::vector<Tensor> out = executor.run(exec::views(parts), stream);
                const std::vector<Tensor> again = executor.run(exec::views(parts), stream);
                for (std::size_t i = 0; i < out.size(); ++i) {
                  const std::string what =
                      fmt::format("{} chunks {} streams {} output {} rank {}", to_string(form),
                                  chunks, streams, i, comm->rank());
                  const Tensor a = to_cpu(out[i], stream), b = to_cpu(again[i], stream);
                  EXPECT_TRUE(testing::bitwise_equal(a, b)) << what << " differs run to run";
                  exec::expect_normwise_close(a, to_cpu(base[i], stream), tol, what, 1.0);
                }
              }
          },
          options);
    }
}

// The vocabulary-parallel fused loss in bf16 on CUDA tensors (2 ranks as threads on GPU 0, the
// local backend): fp32 chunk logits from linear's f32 output on cuBLASLt, grad_bias from their
// fp32 gradient, the bias widened once; per-row losses within 1e-4 of the one-device program on
// the CPU, grad_bias within two bf16 ulps, the other gradients normwise within a few bf16
// roundings.
TEST(ExecutorCuda, VocabularyParallelFusedLossInBf16OnLocalRanksMatchesOneDevice) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Program single = exec::fused_loss_program(DType::BF16, Reduction::None, true, std::nullopt);
  const std::vector<Tensor> whole = exec::whole_inputs(single);
  LocalWorld one(1);
  const std::vector<Tensor> expected =
      MultiDeviceExecutor(single, one.communicator(0)).run(exec::views(whole));
  CommOptions options;
  options.timeout = 20s;
  run_local(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        const CudaStream stream(0);
        const Program sharded =
            exec::fused_loss_program(DType::BF16, Reduction::None, true, exec::line(*comm));
        std::vector<Tensor> parts;
        for (std::size_t i = 0; i < whole.size(); ++i)
          parts.push_back(
              on(shard_tensor(whole[i], *sharded.mesh(),
                              exec::placements_of(sharded, sharded.inputs()[i]), comm->rank()),
                 kCuda, stream));
        MultiDeviceExecutor executor(sharded, comm);
        const std::vector<Tensor> out = executor.run(exec::views(parts), stream);
        const Plan& plan = executor.plan(DeviceType::CUDA);
        EXPECT_NE(plan.to_string().find("with all_gather of its row statistics"), std::string::npos)
            << plan.to_string();
        ASSERT_EQ(out.size(), expected.size());
        for (std::size_t i = 0; i < out.size(); ++i) {
          const PlanValue& v = plan.values[static_cast<std::size_t>(plan.outputs[i])];
          const Tensor got = to_cpu(gather_tensor(out[i], expected[i].shape(), *sharded.mesh(),
                                                  v.placements, comm, stream),
                                    stream);
          const std::string what = fmt::format("output {} on rank {}", i, comm->rank());
          if (i == 0) {
            expect_close(got, expected[i], 1e-4, what);
            continue;
          }
          if (i == 3) {  // grad_bias: sums of the fp32 gradient, rounded once (two bf16 ulps)
            const testing::Diff d = testing::compare(got, expected[i], 1e-6, 0x1p-7);
            EXPECT_EQ(d.violations, 0) << what << ": max rel err " << d.max_rel_err;
          }
          exec::expect_normwise_close(got, expected[i], 2e-2, what);
        }
      },
      options);
}

TEST(Executor, AProgramWithoutAMeshRunsWholeOnOneRank) {
  Program p;
  const Value x = p.define_tensor("x", {3, 8}, DType::F32);
  const Value w = p.define_tensor("w", {8}, DType::F32);
  p.add_output(p.rmsnorm(x, w, 1e-6));
  const Plan plan = lower(p, 0, CommunicatorBackend::Local);
  ASSERT_EQ(plan.steps.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<Compute>(plan.steps[0]));
  const Tensor xs = randn({3, 8}, DType::F32, 1), ws = randn({8}, DType::F32, 2);
  Tensor expected({3, 8}, DType::F32);
  rmsnorm(xs, ws, expected, {}, 1e-6);
  LocalWorld world(1);
  MultiDeviceExecutor executor(p, world.communicator(0));
  const std::vector<Tensor> out = executor.run({xs, ws});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(values(out[0]), values(expected));
}

TEST(Executor, BadOverlapParamsAreErrorsWhenGivenNotAtTheFirstRun) {
  LocalWorld world(1);
  const auto comm = world.communicator(0);
  Program p;
  p.add_output(p.define_tensor("x", {2, 3}, DType::F32));
  MultiDeviceExecutorParams bad;
  bad.overlap.chunks = -3;
  test::expect_error([&] { MultiDeviceExecutor(p, comm, bad); }, ErrorCode::InvalidArgument,
                     {"chunks must be >= 1", "-3"});
  MultiDeviceExecutor executor(p, comm);
  bad.overlap = {};
  bad.overlap.number_of_streams = 0;
  test::expect_error([&] { executor.set_params(bad); }, ErrorCode::InvalidArgument,
                     {"number_of_streams must be >= 1"});
  EXPECT_EQ(executor.params().overlap.number_of_streams, 2);
}

TEST(Executor, PlansAreCachedPerBackendAndEachCommunicationNamesIt) {
  LocalWorld world(4);
  Program p;
  const Value x = p.define_tensor("x", {10, 4}, DType::F32);
  p.set_mesh(DeviceMesh::of_shape({4}));
  p.set_placements(x, {Shard{0}});
  p.add_output(x, {Replicate{}});
  MultiDeviceExecutor executor(p, world.communicator(2));
  EXPECT_EQ(executor.plan().backend, CommunicatorBackend::Local);
  EXPECT_EQ(executor.cached_plans(), 1u);
  MultiDeviceExecutorParams on_gloo;
  on_gloo.lowering.communicator_backend = CommunicatorBackend::Gloo;
  executor.set_params(on_gloo);
  const Plan& gloo = executor.plan();
  EXPECT_EQ(executor.cached_plans(), 2u);
  ASSERT_EQ(gloo.steps.size(), 1u);
  const auto& c = std::get<Communication>(gloo.steps[0]);
  EXPECT_EQ(c.backend, CommunicatorBackend::Gloo);
  EXPECT_EQ(c.to_string(),
            "all_gather(dim 0) on gloo, mesh dim 0, team [0 1 2 3], sizes [3 3 2 2]");
  EXPECT_NE(gloo.to_string().find("$1 %0 [Replicate()] [10, 4] f32 = all_gather(dim 0) on gloo"),
            std::string::npos)
      << gloo.to_string();
  executor.set_params({});
  EXPECT_EQ(executor.plan().backend, CommunicatorBackend::Local);
  EXPECT_EQ(executor.cached_plans(), 2u);
}

// y = a + b passes its gradient to both operands as it is: grad gives one output each, and the
// executor returns them as two tensors (a value returned twice is copied, as an input is).
TEST(Executor, TheOperandsOfAnAddGetTheirGradientsAsTwoTensors) {
  Program p;
  const Value a = p.define_tensor("a", {2, 3}, DType::F32);
  const Value b = p.define_tensor("b", {2, 3}, DType::F32);
  const Value y = p.add(a, b);
  p.add_output(y);
  const Program joint = grad(p, y, {a, b});
  ASSERT_EQ(joint.outputs().size(), 3u);
  LocalWorld world(1);
  MultiDeviceExecutor executor(joint, world.communicator(0));
  const Tensor x = from({2, 3}, DType::F32, {1, 2, 3, 4, 5, 6});
  const Tensor g = from({2, 3}, DType::F32, {6, 5, 4, 3, 2, 1});
  const std::vector<Tensor> out = executor.run({x, x, g});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(values(out[0]), (std::vector<double>{2, 4, 6, 8, 10, 12}));
  EXPECT_EQ(values(out[1]), values(g));
  EXPECT_EQ(values(out[2]), values(g));
  EXPECT_NE(out[1].view().data(), out[2].view().data());
  EXPECT_NE(out[1].view().data(), g.view().data());
}

// The gradient of a Partial input is the whole gradient on every rank: Replicate, lowered and
// equal to the one-device gradient (x given as four exact quarters).
TEST(ExecutorLocal, TheGradientOfAPartialInputIsReplicate) {
  on_four_ranks([](const std::shared_ptr<Communicator>& comm) {
    Program p;
    const Value x = p.define_tensor("x", {4, 8}, DType::F32);
    const Value w = p.define_tensor("w", {6, 8}, DType::F32);
    const Value y = p.linear(x, w);
    p.add_output(y);
    p.set_mesh(DeviceMesh::of_shape({4}));
    p.set_placements(x, {Partial{}});
    const Program joint = grad(p, y, {x, w});
    ASSERT_EQ(joint.output_placements().size(), 3u);
    EXPECT_EQ(joint.output_placements()[1], (std::vector<Placement>{Replicate{}}));
    Tensor xs({4, 8}, DType::F32), ws({6, 8}, DType::F32), gs({4, 6}, DType::F32);
    for (std::int64_t i = 0; i < xs.numel(); ++i) xs.data_ptr<float>()[i] = float(i % 7 - 3);
    for (std::int64_t i = 0; i < ws.numel(); ++i) ws.data_ptr<float>()[i] = float(i % 5 - 2);
    for (std::int64_t i = 0; i < gs.numel(); ++i) gs.data_ptr<float>()[i] = float(i % 3 - 1);
    Tensor quarter = Tensor::copy_of(xs);
    for (std::int64_t i = 0; i < quarter.numel(); ++i) quarter.data_ptr<float>()[i] /= 4;
    Program single = p;
    single.set_placements(x, {Replicate{}});
    const std::vector<Tensor> want =
        MultiDeviceExecutor(grad(single, y, {x, w}), comm).run({xs, ws, gs});
    const std::vector<Tensor> got = MultiDeviceExecutor(joint, comm).run({quarter, ws, gs});
    ASSERT_EQ(got.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i)
      EXPECT_EQ(values(got[i]), values(want[i])) << "output " << i;
  });
}

// Per-token outputs wanted as Shard(0): grad_loss comes as the loss is output, each rank passing
// its rows of the upstream gradient, and the gradients match one device's.
TEST(ExecutorLocal, GradLossLiesAsTheLossIsOutput) {
  on_four_ranks([](const std::shared_ptr<Communicator>& comm) {
    exec::expect_matches_single_device(
        [&](bool sharded) {
          Program p;
          const Value x = p.define_tensor("x", {10, 8}, DType::F32);
          const Value w = p.define_tensor("w", {8}, DType::F32);
          const Value y = p.rmsnorm(x, w, 1e-6);
          if (sharded) {
            p.set_mesh(DeviceMesh::of_shape({4}));
            p.set_placements(x, {Shard{0}});
            p.add_output(y, {Shard{0}});
          } else {
            p.add_output(y);
          }
          const Program joint = grad(p, y, {x, w});
          if (sharded) {
            EXPECT_EQ(joint.placements(joint.inputs().back()), p.output_placements()[0]);
          }
          return joint;
        },
        comm, 1e-5);
  });
}

// Partial outputs made locally (DTensor's partition of a value), term by term: a Replicate's sum
// on the first rank of the mesh dimension and zeros elsewhere; a shard of a sum padded with zeros,
// of a product with ones; a max all-gathered, then kept on every rank. On a 2 x 2 mesh with
// [Partial(sum), Partial(avg)] the sum's zeros are kept by the average, as shard_tensor places
// them; Partials that do not commute, [Partial(max), Partial(sum)], are refused (the value would
// depend on the plan's order of reductions: a fuzz found one program give two).
TEST(ExecutorLocal, PartialOutputsArePartitionedTermByTerm) {
  const Tensor whole = from({5, 2}, DType::F32, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  on_four_ranks([&](const std::shared_ptr<Communicator>& comm) {
    const int rank = comm->rank();
    const auto run = [&](const DeviceMesh& mesh, const std::vector<Placement>& in,
                         const std::vector<Placement>& out, std::size_t steps) {
      Program p;
      const Value x = p.define_tensor("x", whole.shape(), DType::F32);
      p.set_mesh(mesh);
      p.set_placements(x, in);
      p.add_output(x, out);
      MultiDeviceExecutor executor(p, comm);
      const Tensor term = executor.run({shard_tensor(whole, mesh, in, rank)})[0];
      EXPECT_EQ(executor.plan().steps.size(), steps) << executor.plan().to_string();
      EXPECT_TRUE(std::holds_alternative<Partition>(executor.plan().steps.back()));
      exec::expect_terms_of(term, whole, mesh, out, comm, to_string(in) + " -> " + to_string(out));
      return values(term);
    };
    const DeviceMesh line = DeviceMesh::of_shape({4});
    const std::vector<double> zeros(10, 0.0);
    EXPECT_EQ(run(line, {Replicate{}}, {Partial{}}, 1), rank == 0 ? values(whole) : zeros);
    // Rows [2 1 1 1] over the ranks.
    const std::vector<std::vector<double>> padded_sum = {{1, 2, 3, 4, 0, 0, 0, 0, 0, 0},
                                                         {0, 0, 0, 0, 5, 6, 0, 0, 0, 0},
                                                         {0, 0, 0, 0, 0, 0, 7, 8, 0, 0},
                                                         {0, 0, 0, 0, 0, 0, 0, 0, 9, 10}};
    EXPECT_EQ(run(line, {Shard{0}}, {Partial{}}, 1), padded_sum[static_cast<std::size_t>(rank)]);
    std::vector<double> padded_prod = padded_sum[static_cast<std::size_t>(rank)];
    for (double& v : padded_prod)
      if (v == 0) v = 1;
    EXPECT_EQ(run(line, {Shard{0}}, {Partial{ReduceOp::Prod}}, 1), padded_prod);
    EXPECT_EQ(run(line, {Shard{0}}, {Partial{ReduceOp::Max}}, 2), values(whole));

    const DeviceMesh square = DeviceMesh::of_shape({2, 2});
    const std::vector<Placement> mixed = {Partial{}, Partial{ReduceOp::Avg}};
    const std::vector<std::vector<double>> mixed_terms = {values(whole), values(whole), zeros,
                                                          zeros};
    EXPECT_EQ(run(square, {Replicate{}, Replicate{}}, mixed, 2),
              mixed_terms[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(values(shard_tensor(whole, square, mixed, rank)),
              mixed_terms[static_cast<std::size_t>(rank)]);
    // An inner Partial while the outer mesh dimension gathers the tensor dim the inner one
    // shards: both gathered first (it was an error, and once reached std::get<Shard> on the
    // Partial).
    run(square, {Shard{0}, Shard{0}}, {Replicate{}, Partial{}}, 3);

    const std::vector<Placement> max_of_sums = {Partial{ReduceOp::Max}, Partial{}};
    Program p;
    const Value x = p.define_tensor("x", whole.shape(), DType::F32);
    p.set_mesh(square);
    expect_error([&] { p.set_placements(x, max_of_sums); }, ErrorCode::InvalidArgument,
                 {"Program.set_placements: %0 'x'", "[Partial(max), Partial(sum)]",
                  "mixes reductions that do not commute"});
    expect_error([&] { p.add_output(x, max_of_sums); }, ErrorCode::InvalidArgument,
                 {"Program.add_output", "do not commute"});
    expect_error(
        [&] { shard_tensor(whole, square, max_of_sums, rank); }, ErrorCode::InvalidArgument,
        {"shard_tensor: [Partial(max), Partial(sum)] mixes reductions that do not commute"});
    // In gather_tensor's words, not those of the program it builds (a fuzz saw "Program.
    // set_placements: %0 'local'", which the caller never wrote).
    expect_error([&] { gather_tensor(whole, whole.shape(), square, max_of_sums, comm); },
                 ErrorCode::InvalidArgument,
                 {"gather_tensor: placements: [Partial(max), Partial(sum)] mixes reductions"});
  });
}

TEST(Executor, ShardTensorCopiesTheRanksPartAndPartitionsPartial) {
  const Tensor t = from({5, 2}, DType::F32, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  const DeviceMesh mesh = DeviceMesh::of_shape({2});
  EXPECT_EQ(values(shard_tensor(t, mesh, {Shard{0}}, 1)), (std::vector<double>{6, 7, 8, 9}));
  EXPECT_EQ(values(shard_tensor(t, mesh, {Shard{1}}, 1)), (std::vector<double>{1, 3, 5, 7, 9}));
  EXPECT_EQ(values(shard_tensor(t, mesh, {Partial{}}, 0)), values(t));
  EXPECT_EQ(values(shard_tensor(t, mesh, {Partial{}}, 1)), std::vector<double>(10, 0.0));
  EXPECT_EQ(values(shard_tensor(t, mesh, {Partial{ReduceOp::Prod}}, 1)),
            std::vector<double>(10, 1.0));
  EXPECT_EQ(values(shard_tensor(t, mesh, {Partial{ReduceOp::Max}}, 1)), values(t));
  const Tensor i64 = from({2}, DType::I64, {3, 4});
  expect_error([&] { shard_tensor(i64, mesh, {Partial{ReduceOp::Avg}}, 1); },
               ErrorCode::InvalidArgument, {"shard_tensor: Partial(avg) cannot reduce i64 values"});
  expect_error([&] { shard_tensor(t, mesh, {Shard{0}}, 2); }, ErrorCode::InvalidArgument,
               {"shard_tensor", "rank 2"});
  expect_error(
      [&] {
        shard_tensor(t, mesh, {Shard{0}, Shard{0}}, 0);
      },
      ErrorCode::InvalidArgument, {"shard_tensor: 2 placements", "one per mesh dimension"});
  expect_error([&] { shard_tensor(t, mesh, {Shard{2}}, 0); }, ErrorCode::InvalidArgument,
               {"shard_tensor: Shard(2)", "outside"});
}

// Only a sum's terms all have the whole gradient: grad() of an input or a loss placed Partial with
// another reduction is Unsupported, naming it (avg once gave every rank n times its gradient).
TEST(Executor, GradOfANonSumPartialIsUnsupported) {
  for (const ReduceOp op : {ReduceOp::Avg, ReduceOp::Max}) {
    Program p;
    const Value x = p.define_tensor("x", {4, 8}, DType::F32);
    const Value y = p.add(x, x);
    p.set_mesh(DeviceMesh::of_shape({4}));
    p.set_placements(x, {Partial{op}});
    p.add_output(y);
    expect_error([&] { grad(p, y, {x}); }, ErrorCode::Unsupported,
                 {"grad: %0 'x'", "is placed " + to_string(std::vector<Placement>{Partial{op}}),
                  "only Partial(sum)"});
    Program q;
    const Value a = q.define_tensor("a", {4, 8}, DType::F32);
    const Value b = q.add(a, a);
    q.set_mesh(DeviceMesh::of_shape({4}));
    q.add_output(b, {Partial{op}});
    expect_error([&] { grad(q, b, {a}); }, ErrorCode::Unsupported,
                 {"grad: the loss", "is output as", "only Partial(sum)"});
  }
}

TEST(Executor, GradWithRespectToNothingIsAnError) {
  Program p;
  const Value x = p.define_tensor("x", {4, 8}, DType::F32);
  const Value w = p.define_tensor("w", {8, 8}, DType::F32);
  const Value y = p.matmul(x, w);
  p.add_output(y);
  expect_error([&] { grad(p, y, {}); }, ErrorCode::InvalidArgument,
               {"grad: wrt is empty", "the loss %2"});
}

}  // namespace
}  // namespace meshfuse::test
