// The local backend on CUDA tensors: ranks as threads of this process, each queuing on a stream of
// its own. The communicator suite of dist_cases.h on 2 and 4 ranks, all on GPU 0 and spread over
// the GPUs (rank r on GPU r % cuda_device_count()); every reduction dtype against the host;
// in-place all_reduce bitwise equal on every rank and run to run; operations alternating between
// two streams; an operation that returns before the device has run it. Skips without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <ostream>
#include <vector>

#include "dist_cases.h"
#include "distributed/reduce.h"
#include "meshfuse/distributed/communicator.h"
#include "test_util.h"

#ifdef MESHFUSE_WITH_CUDA
#include "core/cuda/runtime.h"
#endif

namespace meshfuse::test {
namespace {

using namespace std::chrono_literals;

struct Layout {
  int ranks;
  bool spread;  // rank r on GPU r % cuda_device_count(), else every rank on GPU 0
};

std::string layout_str(const Layout& l) {
  return fmt::format("{}Ranks{}", l.ranks, l.spread ? "Spread" : "OnGpu0");
}
std::string layout_name(const ::testing::TestParamInfo<Layout>& info) {
  return layout_str(info.param);
}
void PrintTo(const Layout& l, std::ostream* out) { *out << layout_str(l); }

int device_of(const Communicator& c, bool spread) {
  return spread ? c.rank() % cuda_device_count() : 0;
}

// Runs fn on `ranks` threads of a LocalWorld, each rank's checks on a stream of its GPU
// (dist::place()); a failing test times out in seconds.
void on_gpus(int ranks, bool spread, const std::function<void(Communicator&)>& fn,
             std::chrono::milliseconds timeout = 20s) {
  CommOptions options;
  options.timeout = timeout;
  run_local(
      ranks,
      [&](Communicator& c) {
        const CudaStream stream(device_of(c, spread));
        dist::place() = stream;
        try {
          fn(c);
        } catch (...) {
          dist::place() = Stream{};
          throw;
        }
        synchronize(stream);
        dist::place() = Stream{};
      },
      options);
}

class DistLocalCuda : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "needs a CUDA device";
  }
  void run(const std::function<void(Communicator&)>& fn) {
    on_gpus(GetParam().ranks, GetParam().spread, fn);
  }
};

INSTANTIATE_TEST_SUITE_P(Layouts, DistLocalCuda,
                         ::testing::Values(Layout{2, false}, Layout{4, false}, Layout{2, true},
                                           Layout{4, true}),
                         layout_name);

TEST_P(DistLocalCuda, EveryCollectiveGivesTheExpectedValuesForEveryDtypeAndShardKind) {
  run(dist::check_every_collective);
}

TEST_P(DistLocalCuda, EveryCollectiveWorksWithoutTheMetadataCheck) {
  run([](Communicator& c) {
    c.set_checks(false);
    dist::check_every_collective(c);
  });
}

TEST_P(DistLocalCuda, SeveralOperationsInFlightCompleteInAnyWaitOrder) {
  run(dist::check_many_in_flight);
}

TEST_P(DistLocalCuda, ASendRecvRingPassesATensorAllTheWayRound) { run(dist::check_ring_pass); }

TEST_P(DistLocalCuda, SplitAndNewGroupFormSubTeamsThatCommunicate) { run(dist::check_sub_teams); }

TEST_P(DistLocalCuda, MismatchedCallsFailOnEveryRankNamingTheRanksAndWhatDiffered) {
  if (GetParam().ranks != 4) GTEST_SKIP() << "the mismatch case needs 4 ranks";
  run(dist::check_mismatch);
}

TEST_P(DistLocalCuda, ARankThatNeverCallsGivesTheOthersATimeout) { run(dist::check_timeout); }

TEST_P(DistLocalCuda, ARankThatComesAfterTheOthersTimedOutLeavesThemRunningCleanly) {
  run(dist::check_late_rank_after_timeout);
}

TEST_P(DistLocalCuda, ARankThatThrowsStopsTheOthersWaitingInACudaCollective) {
  // The last rank throws; the others wait for it in a CUDA all_reduce (no metadata check, so on
  // the CUDA side's meeting), which run_local's abort must end long before the timeout.
  const int last = GetParam().ranks - 1;
  const auto start = std::chrono::steady_clock::now();
  expect_error(
      [&] {
        on_gpus(
            GetParam().ranks, GetParam().spread,
            [&](Communicator& c) {
              if (c.rank() == last) fail(ErrorCode::Internal, "rank {} failed", c.rank());
              c.set_checks(false);
              Tensor t = Tensor::zeros({64}, DType::F32,
                                       Device{DeviceType::CUDA, device_of(c, GetParam().spread)},
                                       dist::place());
              c.all_reduce(t, ReduceOp::Sum, dist::place()).wait();
            },
            120s);
      },
      ErrorCode::Internal, {fmt::format("rank {} failed", last)});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

// Rank r's input for the dtype tests: normal values (scaled for the integer types) from a seed of
// its own, made on the host.
Tensor host_input(int rank, std::int64_t n, DType dtype, std::uint64_t salt) {
  const bool integral = !is_floating_point(dtype);
  Tensor f =
      randn({n}, DType::F64, 1000 * salt + static_cast<std::uint64_t>(rank), integral ? 20.0 : 1.0);
  if (dtype == DType::U8 || dtype == DType::U32) {
    double* p = f.data_ptr<double>();
    for (std::int64_t i = 0; i < n; ++i) p[i] = std::abs(std::round(p[i]));
  }
  Tensor t({n}, dtype);
  copy(f, t);
  return t;
}

std::vector<std::uint8_t> host_bytes(const TensorView& t) {
  const bool gpu = t.device().type == DeviceType::CUDA;
  Tensor host(t.shape(), t.dtype());
  copy(t, host, gpu ? dist::place() : Stream{});  // from a GPU: waits for the stream
  const auto* p = static_cast<const std::uint8_t*>(host.view().data());
  return {p, p + t.nbytes()};
}

// Every reduction dtype and op, all_reduce and reduce_scatter (uneven), against the CPU's
// reduction of the same inputs in the same rank order (fp32 for 16-bit floats, rounded once):
// bitwise equal, and the floats close to an f64 sum.
TEST_P(DistLocalCuda, EveryReductionDtypeMatchesTheHostBitForBit) {
  const std::vector<DType> dtypes = {DType::F32, DType::F64, DType::F16, DType::BF16,
                                     DType::I32, DType::I64, DType::U8,  DType::U32};
  run([&](Communicator& c) {
    const std::int64_t n = 1029;  // odd: chunks and the kernel's tail on every path
    for (DType dtype : dtypes) {
      for (ReduceOp op : dist::kReduceOps) {
        if (op == ReduceOp::Avg && !is_floating_point(dtype)) continue;
        const std::string what =
            fmt::format("{} {} rank {}", to_string(dtype), to_string(op), c.rank());
        std::vector<Tensor> inputs;
        std::vector<const void*> srcs;
        for (int r = 0; r < c.size(); ++r) {
          inputs.push_back(host_input(r, n, dtype, static_cast<std::uint64_t>(op) + 1));
          srcs.push_back(inputs.back().view().data());
        }
        Tensor expected({n}, dtype);
        detail::reduce_buffers(dtype, op, srcs, expected.view().data(), n);

        Tensor gpu({n}, dtype, dist::place().device, dist::place());
        copy(inputs[c.rank()], gpu, dist::place());
        c.all_reduce(gpu, op, dist::place()).wait();
        EXPECT_EQ(host_bytes(gpu), host_bytes(expected)) << "all_reduce " << what;

        // Uneven reduce_scatter of the same inputs as rows of 3: rank r keeps 343 / size rows,
        // and one more for the first 343 % size ranks.
        std::vector<std::int64_t> rows(c.size());
        for (int r = 0; r < c.size(); ++r) rows[r] = n / 3 / c.size() + (r < n / 3 % c.size());
        const auto starts = dist::prefix_sums(rows);
        Tensor in({n / 3, 3}, dtype, dist::place().device, dist::place());
        copy(inputs[c.rank()].view().reshape({n / 3, 3}), in, dist::place());
        Tensor out({rows[c.rank()], 3}, dtype, dist::place().device, dist::place());
        c.reduce_scatter(in, out, rows, op, dist::place()).wait();
        const std::vector<std::uint8_t> all = host_bytes(expected);
        const std::size_t es = element_size(dtype);
        const std::vector<std::uint8_t> mine(all.begin() + starts[c.rank()] * 3 * es,
                                             all.begin() + starts[c.rank() + 1] * 3 * es);
        EXPECT_EQ(host_bytes(out), mine) << "reduce_scatter " << what;

        if (is_floating_point(dtype) && op == ReduceOp::Sum) {
          Tensor exact = Tensor::zeros({n}, DType::F64);
          for (const Tensor& x : inputs) {
            Tensor x64({n}, DType::F64);
            copy(x, x64);
            for (std::int64_t i = 0; i < n; ++i)
              exact.data_ptr<double>()[i] += x64.data_ptr<double>()[i];
          }
          Tensor got({n}, DType::F64);
          copy(gpu, got, dist::place());
          expect_close(got, exact, dtype == DType::F16 || dtype == DType::BF16 ? 1e-2 : 1e-5,
                       "all_reduce against f64 " + what);
        }
      }
    }
  });
}

// In place, large enough for every rank's chunk to take the vector path: every rank holds the
// same bits, and so does a second run.
TEST_P(DistLocalCuda, InPlaceAllReduceIsBitwiseEqualOnEveryRankAndRunToRun) {
  for (DType dtype : {DType::BF16, DType::F32}) {
    std::vector<std::vector<std::uint8_t>> results;
    std::mutex mutex;
    for (int run_index = 0; run_index < 2; ++run_index) {
      run([&](Communicator& c) {
        const std::int64_t n = (1 << 20) + 7;
        const Tensor host = host_input(c.rank(), n, dtype, 77);
        Tensor t({n}, dtype, dist::place().device, dist::place());
        copy(host, t, dist::place());
        c.all_reduce(t, ReduceOp::Sum, dist::place()).wait();
        std::vector<std::uint8_t> bytes = host_bytes(t);
        std::lock_guard lock(mutex);
        results.push_back(std::move(bytes));
      });
    }
    ASSERT_EQ(results.size(), 2u * GetParam().ranks);
    for (std::size_t i = 1; i < results.size(); ++i)
      EXPECT_TRUE(results[i] == results[0]) << to_string(dtype) << ": result " << i << " differs";
  }
}

// The executor issues chunk i's collective on stream i % 2: operations alternate between two
// streams of a rank and each gives its own result.
TEST_P(DistLocalCuda, OperationsAlternatingBetweenTwoStreamsGiveCorrectResults) {
  run([](Communicator& c) {
    const CudaStream other(dist::place().device.index);
    const Stream streams[2] = {dist::place(), other};
    const Stream first = dist::place();
    std::vector<Tensor> reduced, gathered, shards;
    std::vector<Work> works;
    const std::int64_t n = 4099;
    for (int i = 0; i < 8; ++i) {
      dist::place() = streams[i % 2];  // each tensor made on the stream of its operation
      reduced.push_back(dist::tensor_of(dist::values(c.rank(), n + i), DType::F32, {n + i}));
      works.push_back(c.all_reduce(reduced.back(), ReduceOp::Sum, streams[i % 2]));
      shards.push_back(
          dist::tensor_of(dist::values(c.rank(), 5, ReduceOp::Sum, i), DType::BF16, {5}));
      gathered.push_back(dist::zeros({5 * c.size()}, DType::BF16));
      works.push_back(c.all_gather(shards.back(), gathered.back(), streams[i % 2]));
    }
    for (Work& w : works) w.wait();
    dist::place() = first;
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(dist::values_of(reduced[i]), dist::reduced(c.size(), n + i, ReduceOp::Sum))
          << "all_reduce " << i;
      std::vector<double> expected;
      for (int r = 0; r < c.size(); ++r) {
        const auto v = dist::values(r, 5, ReduceOp::Sum, i);
        expected.insert(expected.end(), v.begin(), v.end());
      }
      EXPECT_EQ(dist::values_of(gathered[i]), expected) << "all_gather " << i;
    }
    synchronize(other);
  });
}

#ifdef MESHFUSE_WITH_CUDA
// The call queues the operation and returns: behind 300 ms of device work on every rank's stream
// it is not complete at once, and is once waited on.
TEST_P(DistLocalCuda, AnOperationReturnsBeforeTheDeviceHasRunIt) {
  run([](Communicator& c) {
    Tensor t = dist::tensor_of(dist::values(c.rank(), 64), DType::F32, {64});
    // A first all_reduce puts its scratch in the pool: the timed one allocates from the cache, so
    // no allocation growing the pool (which synchronises the device when it is full, e.g. under
    // other test processes) makes the call wait.
    Tensor warm = dist::tensor_of(dist::values(c.rank(), 64), DType::F32, {64});
    c.all_reduce(warm, ReduceOp::Sum, dist::place()).wait();
    c.barrier(dist::place()).wait();  // set-up done, every rank here
    detail::cuda_hold(dist::place(), 300'000);
    const auto start = std::chrono::steady_clock::now();
    Work w = c.all_reduce(t, ReduceOp::Sum, dist::place());
    EXPECT_LT(std::chrono::steady_clock::now() - start, 200ms) << "the call waited for the device";
    EXPECT_FALSE(w.is_completed());
    w.wait();
    EXPECT_TRUE(w.is_completed());
    EXPECT_EQ(dist::values_of(t), dist::reduced(c.size(), 64, ReduceOp::Sum));
  });
}
#endif

// Without the metadata check the call itself meets the other ranks: a rank that never calls
// gives the others a Timeout from the call, within the timeout.
TEST(DistLocalCudaTimeout, ARankThatNeverArrivesGivesTheOthersATimeoutWithinTheTimeout) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a CUDA device";
  on_gpus(
      2, false,
      [](Communicator& c) {
        c.set_checks(false);
        if (c.rank() == 1) return;
        Tensor t = dist::zeros({16}, DType::F32);
        const auto start = std::chrono::steady_clock::now();
        expect_error([&] { c.all_reduce(t, ReduceOp::Sum, dist::place()); }, ErrorCode::Timeout,
                     {"all_reduce(sum) f32 x 16", "not finished after 300 ms"});
        const auto took = std::chrono::steady_clock::now() - start;
        EXPECT_GE(took, 290ms);
        EXPECT_LT(took, 3s);
      },
      300ms);
}

TEST(DistLocalCudaErrors, ARecvOfAnotherSizeFails) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a CUDA device";
  on_gpus(2, false, [](Communicator& c) {
    if (c.rank() == 0) {
      c.send(dist::zeros({4}, DType::F32), 1, 0, dist::place()).wait();
    } else {
      expect_error([&] { c.recv(dist::zeros({2}, DType::F32), 0, 0, dist::place()).wait(); },
                   ErrorCode::CommunicationFailure,
                   {"recv f32 x 2", "recv of 8 bytes matched a send of 16 bytes"});
    }
  });
}

TEST(DistLocalCudaErrors, ARankKeepsItsFirstDevice) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  on_gpus(1, false, [](Communicator& c) {
    c.barrier(dist::place()).wait();
    const CudaStream on_one(1);
    Tensor t = Tensor::zeros({4}, DType::F32, Device{DeviceType::CUDA, 1}, on_one);
    expect_error([&] { c.all_reduce(t, ReduceOp::Sum, on_one); }, ErrorCode::DeviceMismatch,
                 {"cuda:0 (the device of its first)", "cuda:1"});
    synchronize(on_one);
  });
}

}  // namespace
}  // namespace meshfuse::test
