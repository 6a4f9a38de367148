// The nccl communicator backend on two GPUs: every collective x f32/bf16/i64 x equal and uneven
// shards against values computed here, the mismatch check, and a timeout.
//
// These tests need two ranks, each with its GPU: CTest runs them as `meshfuse launch -n 2 --
// meshfuse_tests --gtest_filter='DistNccl*'` (the dist_nccl_2gpu entry); in a single process, in
// a build without NCCL, or with fewer than two GPUs they skip.
//
// Rank r's input element i is (r + 1) * (i % 5 + 1): small integers, so every sum, product and
// average of two ranks is exact in bf16 and the expected values can be compared exactly.
#include <gtest/gtest.h>

#include <cstring>

#include "meshfuse/core/platform.h"
#include "meshfuse/distributed/communicator.h"
#include "test_util.h"

namespace meshfuse::test {
namespace {

using namespace std::chrono_literals;

constexpr int kRanks = 2;

double value(int rank, std::int64_t i) { return (rank + 1) * static_cast<double>(i % 5 + 1); }

// Why the tests cannot run here, or empty.
std::string skip_reason() {
  if (!communicator_backend_built(CommunicatorBackend::Nccl)) return "this build has no nccl";
  if (launch_info_from_env().world_size != kRanks)
    return "needs 2 ranks: meshfuse launch -n 2 -- meshfuse_tests --gtest_filter='DistNccl*'";
  if (cuda_device_count() < kRanks) return "needs 2 GPUs";
  return {};
}

// The world communicator (NCCL set up once per process) and a stream on this rank's GPU.
struct World {
  std::shared_ptr<Communicator> comm;
  Device device;
  std::unique_ptr<CudaStream> stream;
};

World& world() {
  static World w = [] {
    CommOptions options;
    options.backend = "cuda:nccl";
    options.timeout = 60s;
    World world;
    world.comm = init_communicator(options);
    world.device = {DeviceType::CUDA, launch_info_from_env().cuda_device()};
    world.stream = std::make_unique<CudaStream>(world.device.index);
    return world;
  }();
  return w;
}

class DistNccl : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (const std::string reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
    comm_ = world().comm.get();
    rank_ = comm_->rank();
  }

  bool floating() const { return GetParam() != DType::I64; }
  const Stream& stream() const { return *world().stream; }

  // A tensor on this rank's GPU holding `values`, converted to the test's dtype.
  Tensor on_gpu(const std::vector<double>& values, Shape shape) const {
    Tensor host(shape, DType::F64);
    std::memcpy(host.data_ptr<double>(), values.data(), values.size() * sizeof(double));
    Tensor gpu(shape, GetParam(), world().device, stream());
    copy(host, gpu, stream());
    return gpu;
  }
  // This rank's input: `rows` x `cols` of value(rank, i), i counting from `first`.
  Tensor input(std::int64_t rows, std::int64_t cols = 3, std::int64_t first = 0) const {
    std::vector<double> v(static_cast<std::size_t>(rows * cols));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = value(rank_, first + static_cast<std::int64_t>(i));
    return on_gpu(v, {rows, cols});
  }
  Tensor filled(Shape shape, double x) const {
    return on_gpu(std::vector<double>(static_cast<std::size_t>(shape_numel(shape)), x), shape);
  }
  // Waits for `work`, then reads `t` back.
  std::vector<double> result(Work work, const TensorView& t) const {
    work.wait();
    EXPECT_EQ(work.record().backend, CommunicatorBackend::Nccl) << work.record().to_string();
    Tensor host(t.shape(), DType::F64);
    copy(t, host, stream());
    return {host.data_ptr<double>(), host.data_ptr<double>() + host.numel()};
  }

  Communicator* comm_ = nullptr;
  int rank_ = 0;
};

double reduce(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::Sum:
      return a + b;
    case ReduceOp::Prod:
      return a * b;
    case ReduceOp::Min:
      return std::min(a, b);
    case ReduceOp::Max:
      return std::max(a, b);
    case ReduceOp::Avg:
      return (a + b) / 2;
  }
  return 0;
}

TEST_P(DistNccl, AllReduceGivesEveryReductionOnEveryRank) {
  std::vector<ReduceOp> ops{ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max};
  if (floating()) ops.push_back(ReduceOp::Avg);
  for (ReduceOp op : ops) {
    const Tensor t = input(333);  // 999 elements: not a multiple of any vector width
    const std::vector<double> got = result(comm_->all_reduce(t, op, stream()), t);
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], reduce(op, value(0, i), value(1, i))) << to_string(op) << " at " << i;
  }
}

TEST_P(DistNccl, BroadcastCopiesTheRootsTensorFromEitherRoot) {
  for (int root = 0; root < kRanks; ++root) {
    const Tensor t = input(5);
    const std::vector<double> got = result(comm_->broadcast(t, root, stream()), t);
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], value(root, i)) << i;
  }
}

TEST_P(DistNccl, ReduceSumsOnTheRootAndLeavesTheOthersAlone) {
  const Tensor t = input(7);
  const std::vector<double> got = result(comm_->reduce(t, 1, ReduceOp::Sum, stream()), t);
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], rank_ == 1 ? value(0, i) + value(1, i) : value(0, i)) << i;
}

TEST_P(DistNccl, AllGatherConcatenatesEqualShardsInRankOrder) {
  const Tensor in = input(4), out = filled({8, 3}, -1);
  const std::vector<double> got = result(comm_->all_gather(in, out, stream()), out);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], value(i / 12, i % 12)) << i;
}

TEST_P(DistNccl, AllGatherConcatenatesUnevenShardsIncludingAnEmptyOne) {
  for (const std::vector<std::int64_t>& rows : {std::vector<std::int64_t>{2, 5}, {0, 3}}) {
    const Tensor in = input(rows[rank_]), out = filled({rows[0] + rows[1], 3}, -1);
    const std::vector<double> got = result(comm_->all_gather(in, out, rows, stream()), out);
    const std::size_t first = static_cast<std::size_t>(rows[0] * 3);
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], i < first ? value(0, i) : value(1, i - first)) << i;
  }
}

TEST_P(DistNccl, ReduceScatterKeepsEachRanksBlockOfTheSum) {
  const Tensor in = input(6), out = filled({3, 3}, -1);
  const std::vector<double> got =
      result(comm_->reduce_scatter(in, out, ReduceOp::Sum, stream()), out);
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::size_t j = rank_ * 9 + i;
    ASSERT_EQ(got[i], value(0, j) + value(1, j)) << i;
  }
}

TEST_P(DistNccl, ReduceScatterKeepsUnevenBlocksOfTheMax) {
  const std::vector<std::int64_t> rows{1, 4};
  const Tensor in = input(5), out = filled({rows[rank_], 3}, -1);
  const std::vector<double> got =
      result(comm_->reduce_scatter(in, out, rows, ReduceOp::Max, stream()), out);
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::size_t j = (rank_ == 0 ? 0 : 3) + i;
    ASSERT_EQ(got[i], std::max(value(0, j), value(1, j))) << i;
  }
}

TEST_P(DistNccl, GatherCollectsOnTheRootAndScatterHandsOutItsBlocks) {
  const Tensor in = input(2), gathered = filled({4, 3}, -1);
  const std::vector<double> got = result(comm_->gather(in, gathered, 1, stream()), gathered);
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], rank_ == 1 ? value(i / 6, i % 6) : -1) << i;

  const Tensor whole = input(4), block = filled({2, 3}, -1);
  const std::vector<double> mine = result(comm_->scatter(whole, block, 0, stream()), block);
  for (std::size_t i = 0; i < mine.size(); ++i) ASSERT_EQ(mine[i], value(0, rank_ * 6 + i)) << i;
}

TEST_P(DistNccl, AllToAllExchangesEqualBlocks) {
  const Tensor in = input(4), out = filled({4, 3}, -1);
  const std::vector<double> got = result(comm_->all_to_all(in, out, {}, {}, stream()), out);
  // Block s of rank r's output is block r of rank s's input.
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], value(static_cast<int>(i / 6), rank_ * 6 + i % 6)) << i;
}

TEST_P(DistNccl, AllToAllExchangesUnevenRowsIncludingEmptyOnes) {
  // Rows sent: rank 0 -> {1 to itself, 3 to rank 1}, rank 1 -> {2 to rank 0, 0 to itself}.
  const std::vector<std::vector<std::int64_t>> sends{{1, 3}, {2, 0}};
  const std::vector<std::int64_t> in_rows = sends[rank_];
  const std::vector<std::int64_t> out_rows{sends[0][rank_], sends[1][rank_]};
  const Tensor in = input(in_rows[0] + in_rows[1]);
  const Tensor out = filled({out_rows[0] + out_rows[1], 3}, -1);
  const std::vector<double> got =
      result(comm_->all_to_all(in, out, in_rows, out_rows, stream()), out);
  std::vector<double> expected;
  for (int source = 0; source < kRanks; ++source) {
    const std::int64_t skip = rank_ == 0 ? 0 : sends[source][0];  // rows before ours at source
    for (std::int64_t i = 0; i < sends[source][rank_] * 3; ++i)
      expected.push_back(value(source, skip * 3 + i));
  }
  EXPECT_EQ(got, expected);
}

TEST_P(DistNccl, SendReachesTheMatchingRecv) {
  const Tensor t = rank_ == 0 ? input(3) : filled({3, 3}, -1);
  Work work = rank_ == 0 ? comm_->send(t, 1, 0, stream()) : comm_->recv(t, 0, 0, stream());
  const std::vector<double> got = result(work, t);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], value(0, i)) << i;
}

// Both ranks send first, 64 MiB of f32 (past NCCL's eager buffers): separate ncclSend/ncclRecv
// calls on one stream would deadlock here. Then parts of different sizes, rank 0's empty.
TEST_P(DistNccl, SendRecvExchangesLargeUnevenAndEmptyPartsBothWays) {
  const int peer = 1 - rank_;
  for (const auto& [mine_rows, peer_rows] :
       {std::pair<std::int64_t, std::int64_t>{std::int64_t{1} << 22, std::int64_t{1} << 22},
        {rank_ * 3, peer * 3}}) {
    const Tensor mine = input(mine_rows, 4);
    const Tensor got = filled({peer_rows, 4}, -1);
    const std::vector<double> back =
        result(comm_->send_recv(mine, peer, got, peer, 0, stream()), got);
    const std::size_t step = back.size() > 4099 ? 4099 : 1;  // every element of the small parts
    for (std::size_t i = 0; i < back.size(); i += step) ASSERT_EQ(back[i], value(peer, i)) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DistNccl, ::testing::Values(DType::F32, DType::BF16, DType::I64),
                         dtype_name);

class DistNcclErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string reason = skip_reason(); !reason.empty()) GTEST_SKIP() << reason;
  }
};

TEST_F(DistNcclErrors, MismatchedCountsFailOnEveryRankNamingThemAndLeaveTheCommunicatorUsable) {
  World& w = world();
  const int rank = w.comm->rank();
  const Tensor t = Tensor::zeros({rank == 0 ? 8 : 16}, DType::F32, w.device, *w.stream);
  expect_error([&] { w.comm->all_reduce(t, ReduceOp::Sum, *w.stream).wait(); },
               ErrorCode::InvalidArgument,
               {"all_reduce", "on nccl", "ranks disagree", "rank 0", "rank 1"});
  const Tensor ok = on(full({8}, DType::F32, rank + 1), w.device, *w.stream);
  w.comm->barrier(*w.stream).wait();
  w.comm->all_reduce(ok, ReduceOp::Sum, *w.stream).wait();
  const int n = w.comm->size();
  EXPECT_EQ(values(to_cpu(ok, *w.stream)), std::vector<double>(8, n * (n + 1) / 2));
}

TEST_F(DistNcclErrors, RecvThatNobodySendsTimesOutAndTheCommunicatorIsThenUnusable) {
  // A team of its own (its own NCCL communicator), which the timeout aborts. Both ranks wait for
  // a message that never comes; the rank whose peer aborted first may see that as a failure of
  // the transport rather than its own timeout.
  World& w = world();
  const std::shared_ptr<Communicator> team = w.comm->new_group({0, 1});
  team->set_timeout(2s);
  const Tensor t = Tensor::zeros({4}, DType::F32, w.device, *w.stream);
  const int peer = 1 - team->rank();
  try {
    team->recv(t, peer, 0, *w.stream).wait();
    ADD_FAILURE() << "a recv that nobody sends to completed";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::CommunicationFailure)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("recv f32 x 4 (16 B) on nccl"), std::string::npos)
        << e.what();
  }
  expect_error([&] { team->all_reduce(t, ReduceOp::Sum, *w.stream).wait(); },
               ErrorCode::CommunicationFailure, {"unusable after an earlier failure", "recv"});
}

TEST_F(DistNcclErrors, TensorOnAnotherGpuIsADeviceMismatch) {
  World& w = world();
  const Device other{DeviceType::CUDA, 1 - w.device.index};
  CudaStream other_stream(other.index);
  const Tensor t = Tensor::zeros({4}, DType::F32, other, other_stream);
  w.comm->set_checks(false);  // the error comes before any communication, on this rank alone
  expect_error([&] { w.comm->all_reduce(t, ReduceOp::Sum, other_stream).wait(); },
               ErrorCode::DeviceMismatch, {"cuda:", "local rank"});
  w.comm->set_checks(true);
  synchronize(other_stream);
}

}  // namespace
}  // namespace meshfuse::test
