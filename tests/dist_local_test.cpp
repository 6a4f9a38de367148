// Communicators on the local backend (4 ranks as threads), and what every backend shares: names,
// backend specs, records, argument errors, the launch environment and the stores.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "dist_cases.h"
#include "meshfuse/distributed/bootstrap.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/distributed/store.h"
#include "test_util.h"

namespace meshfuse::test {
namespace {

using namespace std::chrono_literals;

// Four ranks; a failing test times out in seconds, not minutes.
void on_four_ranks(const std::function<void(Communicator&)>& fn) {
  CommOptions options;
  options.timeout = 20s;
  run_local(4, fn, options);
}

TEST(DistLocal, EveryCollectiveGivesTheExpectedValuesForEveryDtypeAndShardKind) {
  on_four_ranks(dist::check_every_collective);
}

TEST(DistLocal, EveryCollectiveWorksWithoutTheMetadataCheck) {
  on_four_ranks([](Communicator& c) {
    c.set_checks(false);
    dist::check_every_collective(c);
  });
}

// With the checks off nothing compares the calls before they meet, and each rank reads the
// others' buffers by its own sizes: sizes that differ are refused by every rank before a buffer is
// read (they once read and wrote past rank 0's smaller buffers: wrong sums, then a double free or a
// segfault), and the team goes on.
TEST(DistLocal, SizesThatDifferAreRefusedOnEveryRankWithTheChecksOff) {
  on_four_ranks([](Communicator& c) {
    c.set_checks(false);
    const std::int64_t n = c.rank() == 1 ? 8 : 4;  // rank 1's calls are twice the others'
    const auto f32 = [](std::int64_t numel) { return Tensor::zeros({numel}, DType::F32); };
    const auto refused = [&](const std::function<Work()>& call, const std::string& what) {
      expect_error([&] { call().wait(); }, ErrorCode::InvalidArgument,
                   {"local: ranks disagree", what, "set_checks(false)"});
    };
    refused([&] { return c.all_reduce(f32(n)); },
            "rank 0 has all_reduce f32 x 4 but rank 1 has all_reduce f32 x 8");
    refused([&] { return c.reduce(f32(n), 0); },
            "rank 0 has reduce root 0 f32 x 4 but rank 1 has reduce root 0 f32 x 8");
    refused([&] { return c.broadcast(f32(n), 0); },
            "rank 0 has broadcast root 0, 16 bytes but rank 1 has broadcast root 0, 32 bytes");
    refused([&] { return c.all_gather(f32(n), f32(4 * n)); },
            "rank 0 has all_gather f32 counts [4, 4, 4, 4] but rank 1 has all_gather f32 counts "
            "[8, 8, 8, 8]");
    refused([&] { return c.reduce_scatter(f32(4 * n), f32(n)); },
            "rank 0 has reduce_scatter f32 counts [4, 4, 4, 4] but rank 1 has reduce_scatter f32 "
            "counts [8, 8, 8, 8]");
    refused([&] { return c.gather(f32(n), f32(4 * n), 0); },
            "rank 0 has gather root 0, 16 bytes but rank 1 has gather root 0, 32 bytes");
    refused([&] { return c.scatter(f32(4 * n), f32(n), 0); },
            "rank 0 has scatter root 0, 16 bytes but rank 1 has scatter root 0, 32 bytes");
    // Calls of one size that differ in their operation or root read other buffers (a scatter's
    // non-root input is null): refused too.
    refused(
        [&] {
          return c.rank() == 1 ? c.scatter(f32(16), f32(4), 0) : c.gather(f32(4), f32(16), 0);
        },
        "rank 0 has gather root 0, 16 bytes but rank 1 has scatter root 0, 16 bytes");
    refused([&] { return c.broadcast(f32(4), c.rank() == 1 ? 1 : 0); },
            "rank 0 has broadcast root 0, 16 bytes but rank 1 has broadcast root 1, 16 bytes");
    refused([&] { return c.rank() == 1 ? c.barrier() : c.all_reduce(f32(4)); },
            "rank 0 has all_reduce f32 x 4 but rank 1 has barrier");
    expect_error([&] { c.all_to_all(f32(4 * n), f32(4 * n)).wait(); }, ErrorCode::InvalidArgument,
                 {"local: all_to_all: rank 0 sends 4 elements to rank 1, which expects 8"});
    const Tensor ones = Tensor::zeros({4}, DType::F32);
    for (int i = 0; i < 4; ++i) ones.data_ptr<float>()[i] = 1;
    c.all_reduce(ones).wait();
    EXPECT_EQ(values(ones), std::vector<double>(4, 4.0));
  });
}

TEST(DistLocal, SeveralOperationsInFlightCompleteInAnyWaitOrder) {
  on_four_ranks(dist::check_many_in_flight);
}

TEST(DistLocal, ASendRecvRingPassesATensorAllTheWayRound) { on_four_ranks(dist::check_ring_pass); }

TEST(DistLocal, SplitAndNewGroupFormSubTeamsThatCommunicate) {
  on_four_ranks(dist::check_sub_teams);
}

// new_group's ranks refused on one rank only: its next exchange used to pair with the others'
// new_group ("ranks disagree"), or leave them waiting; it is now out of step.
TEST(DistLocal, ANewGroupRefusedOnOneRankLeavesTheTeamFailedOutOfStep) {
  run_local(2, [](Communicator& c) {
    if (c.rank() == 1) {
      expect_error(
          [&] {
            c.new_group({0, 2});
          },
          ErrorCode::InvalidArgument, {"new_group: rank 2 is outside 0..1"});
      expect_error([&] { c.all_reduce(Tensor::zeros({3}, DType::F32)).wait(); },
                   ErrorCode::CommunicationFailure, {"ranks out of step"});
    } else {
      expect_error(
          [&] {
            c.new_group({0, 1});
          },
          ErrorCode::CommunicationFailure, {"ranks out of step"});
    }
  });
}

TEST(DistLocal, MeshTeamsAreTheMeshLinesSplitOnceAndKept) { on_four_ranks(dist::check_mesh_teams); }

TEST(DistLocal, MismatchedCallsFailOnEveryRankNamingTheRanksAndWhatDiffered) {
  on_four_ranks(dist::check_mismatch);
}

TEST(DistLocal, ARankThatNeverCallsGivesTheOthersATimeout) { on_four_ranks(dist::check_timeout); }

// A collective that fails its argument checks on one rank only is skipped there: the next
// exchange pairs the ranks' different operations. It once paired them as a mismatch (leaving the
// team one operation apart for good); the exchange numbers now tell, and the team fails.
TEST(DistLocal, ACollectiveThatFailsItsChecksOnOneRankLeavesTheTeamFailedOutOfStep) {
  run_local(2, [](Communicator& c) {
    const Tensor in = Tensor::zeros({2}, DType::F32);
    if (c.rank() == 1)
      expect_error([&] { c.all_gather(in, Tensor::zeros({5}, DType::F32)); },
                   ErrorCode::ShapeMismatch,
                   {"all_gather: output f32[5] cpu has 5 elements, expected 4 (2 ranks x 2)"});
    const auto out_of_step = [&](const std::function<void()>& call) {
      expect_error(call, ErrorCode::CommunicationFailure,
                   {"ranks out of step", "rank 0: #0 (all_gather f32 x 2)",
                    "rank 1: #1 (all_reduce(sum) f32 x 3)", "cannot be used again"});
    };
    if (c.rank() == 0)
      out_of_step([&] { c.all_gather(in, Tensor::zeros({4}, DType::F32)).wait(); });
    else
      out_of_step([&] { c.all_reduce(Tensor::zeros({3}, DType::F32)).wait(); });
    expect_error([&] { c.barrier().wait(); }, ErrorCode::CommunicationFailure, {"out of step"});
  });
}

TEST(DistLocal, IsCompletedAnswersAtOnceWhileAnotherThreadWaits) {
  on_four_ranks(dist::check_is_completed_while_waiting);
}

TEST(DistLocal, ARankThatComesAfterTheOthersTimedOutLeavesThemRunningCleanly) {
  on_four_ranks(dist::check_late_rank_after_timeout);
}

TEST(DistLocal, BuffersGivenToAWorkOutliveAWaitThatTimedOut) {
  on_four_ranks(dist::check_buffers_outlive_a_timed_out_wait);
}

TEST(DistLocal, ADroppedRecvStillTakesItsMessageAndTheTeamGoesOn) {
  on_four_ranks(dist::check_a_dropped_recv_still_takes_its_message);
}

TEST(DistLocal, OneRankAndThreeRanksWork) {
  for (int n : {1, 3}) {
    run_local(n, [](Communicator& c) {
      for (DType dtype : dist::kDTypes) {
        dist::check_all_reduce(c, dtype, ReduceOp::Sum);
        dist::check_all_gather(c, dtype, true);
        dist::check_reduce_scatter(c, dtype, true, ReduceOp::Sum);
        dist::check_all_to_all(c, dtype, true);
      }
    });
  }
}

TEST(DistLocal, Bf16SumsAreComputedInFp32AndRoundedOnce) {
  // 256 + 1 + 1 + 1 = 259 rounds to 260 in bf16 (8 bits); pairwise bf16 rounding would give 256.
  on_four_ranks([](Communicator& c) {
    Tensor t = dist::tensor_of({c.rank() == 0 ? 256.0 : 1.0}, DType::BF16, {1});
    c.all_reduce(t).wait();
    EXPECT_EQ(dist::values_of(t), std::vector<double>{260.0});
  });
}

TEST(DistLocal, RecordsNameTheOperationTeamBackendAndSize) {
  on_four_ranks([](Communicator& c) {
    c.set_history_size(2);
    Tensor t = Tensor::zeros({1024}, DType::F32);
    Work w = c.all_reduce(t, ReduceOp::Avg);
    w.wait();
    EXPECT_EQ(
        w.record().to_string(),
        fmt::format("all_reduce(avg) f32 x 1024 (4 KiB) on local, team [0 1 2 3], rank {}, #0",
                    c.rank()));
    EXPECT_EQ(w.record().bytes, 4096);
    Tensor out = Tensor::zeros({4096}, DType::F32);
    c.all_gather(t, out).wait();
    c.broadcast(t, 2).wait();
    const std::vector<CommRecord> h = c.history();
    ASSERT_EQ(h.size(), 2u);
    EXPECT_EQ(h[0].op, CommOp::AllGather);
    EXPECT_EQ(h[0].bytes, 4 * 4096);
    EXPECT_EQ(
        h[1].to_string(),
        fmt::format("broadcast f32 x 1024 (4 KiB) on local, team [0 1 2 3], rank {}, root 2, #2",
                    c.rank()));
    EXPECT_EQ(c.backend(), CommunicatorBackend::Local);
#ifdef MESHFUSE_WITH_CUDA
    EXPECT_EQ(c.spec().str(), "cpu:local,cuda:local");
#else
    expect_error([&] { c.backend(DeviceType::CUDA); }, ErrorCode::BackendUnavailable,
                 {"'cpu:local'", "cuda"});
#endif
  });
}

TEST(DistLocal, RecordsCallSplitSizesUnevenOnlyWhenTheyDiffer) {
  on_four_ranks([](Communicator& c) {
    Tensor in = Tensor::zeros({2}, DType::F32), out = Tensor::zeros({8}, DType::F32);
    Work equal = c.all_gather(in, out, {2, 2, 2, 2});
    equal.wait();
    EXPECT_FALSE(equal.record().uneven);
    EXPECT_EQ(
        equal.record().to_string(),
        fmt::format("all_gather f32 x 2 (32 B) on local, team [0 1 2 3], rank {}, #0", c.rank()));
    Tensor mine = Tensor::zeros({c.rank() == 3 ? 3 : 1}, DType::F32);
    Tensor all = Tensor::zeros({6}, DType::F32);
    Work uneven = c.all_gather(mine, all, {1, 1, 1, 3});
    uneven.wait();
    EXPECT_TRUE(uneven.record().uneven);
    EXPECT_NE(uneven.record().to_string().find(" uneven "), std::string::npos)
        << uneven.record().to_string();
  });
}

TEST(DistLocal, SplitSizesWhoseSumWrapsAroundAreRefused) {
  // 2 * (2^63 - 1) + 6 wraps around 2^64 to 4, the tensor's rows: summed unchecked, these sizes
  // passed and the copy ran past the buffers.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  run_local(3, [](Communicator& c) {
    Tensor t = Tensor::zeros({4, 3}, DType::F32);
    expect_error(
        [&] {
          c.all_to_all(t, Tensor::zeros({4, 3}, DType::F32), {kMax, kMax, 6});
        },
        ErrorCode::InvalidArgument,
        {"all_to_all", "input_split_sizes", "add up to more than 2^63 rows"});
  });
}

TEST(DistLocal, AZeroOrNegativeTimeoutIsAnError) {
  CommOptions zero;
  zero.timeout = std::chrono::milliseconds(0);
  expect_error([&] { LocalWorld(2, zero); }, ErrorCode::InvalidArgument,
               {"LocalWorld: timeout: expected > 0 ms", "got 0 ms"});
  run_local(1, [](Communicator& c) {
    expect_error([&] { c.set_timeout(std::chrono::milliseconds(-5)); }, ErrorCode::InvalidArgument,
                 {"set_timeout", "got -5 ms"});
    EXPECT_GT(c.timeout().count(), 0);
  });
}

TEST(DistLocal, BadArgumentsFailOnTheCallingRankBeforeAnyExchange) {
  // Each rank fails on its own: nothing is exchanged, so nothing waits for the others.
  run_local(2, [](Communicator& c) {
    Tensor t = Tensor::zeros({4, 3}, DType::F32);
    expect_error([&] { c.broadcast(t, 2); }, ErrorCode::InvalidArgument,
                 {"broadcast", "root 2", "0..1"});
    expect_error(
        [&] {
          c.all_gather(t, Tensor::zeros({7, 3}, DType::F32));
        },
        ErrorCode::ShapeMismatch,
        {"all_gather: output f32[7, 3] cpu has 21 elements, expected 24 (2 ranks x 12)"});
    // torch's order (output first) is named as such; a size error alone is not.
    const std::string order = "the arguments are (input, output), input first";
    expect_error(
        [&] {
          c.all_gather(Tensor::zeros({8, 3}, DType::F32), t);
        },
        ErrorCode::ShapeMismatch,
        {"all_gather: output f32[4, 3] cpu has 12 elements, expected 48", order});
    expect_error(
        [&] {
          c.reduce_scatter(Tensor::zeros({2, 3}, DType::F32), t);
        },
        ErrorCode::ShapeMismatch,
        {"reduce_scatter: input f32[2, 3] cpu has 6 elements, expected 24", order});
    try {
      c.all_gather(t, Tensor::zeros({7, 3}, DType::F32));
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find(order), std::string::npos) << e.what();
    }
    expect_error(
        [&] {
          c.all_gather(t, Tensor::zeros({8, 3}, DType::I64));
        },
        ErrorCode::DTypeMismatch, {"one dtype"});
    expect_error([&] { c.all_reduce(t.view().transpose(0, 1)); }, ErrorCode::InvalidArgument,
                 {"contiguous"});
    // An undefined tensor (it once read a null pointer as one element) names the argument.
    expect_error([&] { c.all_reduce(TensorView{}); }, ErrorCode::InvalidArgument,
                 {"all_reduce: 'tensor' is undefined"});
    expect_error([&] { c.all_gather(t, TensorView{}); }, ErrorCode::InvalidArgument,
                 {"all_gather: 'output' is undefined"});
    expect_error([&] { c.send_recv(t, 1 - c.rank(), TensorView{}, 1 - c.rank()); },
                 ErrorCode::InvalidArgument, {"send_recv: 'recv_tensor' is undefined"});
    expect_error(
        [&] {
          c.all_gather(t, Tensor::zeros({5, 3}, DType::F32), {2, 3});
        },
        ErrorCode::ShapeMismatch, {"all_gather: input f32[4, 3] cpu has 12 elements, expected"});
    expect_error(
        [&] {
          c.all_gather(t, Tensor::zeros({5, 3}, DType::F32), {4, 2});
        },
        ErrorCode::InvalidArgument, {"output_split_sizes [4 2] add up to 6 rows"});
    expect_error(
        [&] {
          c.reduce_scatter(t, Tensor::zeros({4, 2}, DType::F32), {2, 2});
        },
        ErrorCode::ShapeMismatch, {"every dim but dim 0"});
    expect_error(
        [&] {
          c.all_to_all(t, Tensor::zeros({4, 3}, DType::F32), {1, 2, 1});
        },
        ErrorCode::InvalidArgument, {"input_split_sizes has 3 entries for a team of 2"});
    expect_error([&] { c.all_reduce(Tensor::zeros({4}, DType::I64), ReduceOp::Avg); },
                 ErrorCode::InvalidArgument, {"avg needs a floating dtype"});
    expect_error([&] { c.all_reduce(Tensor::zeros({4}, DType::Bool)); }, ErrorCode::InvalidArgument,
                 {"bool"});
    expect_error([&] { c.send(t, c.rank()); }, ErrorCode::InvalidArgument, {"no sends to self"});
    expect_error([&] { c.send_recv(t, (c.rank() + 1) % c.size(), t, c.rank()); },
                 ErrorCode::InvalidArgument, {"send_recv", "from self"});
    expect_error(
        [&] {
          c.send_recv(t, (c.rank() + 1) % c.size(), Tensor::zeros({4}, DType::BF16),
                      (c.rank() + 1) % c.size());
        },
        ErrorCode::DTypeMismatch, {"send_recv", "one dtype"});
    expect_error([&] { c.new_group({0, 0}); }, ErrorCode::InvalidArgument, {"listed twice"});
    // Input and output sharing memory: all_to_all's gave wrong values silently; all_gather and
    // reduce_scatter take the rank's own block only (in place), not any other overlap.
    Tensor buf = Tensor::zeros({12}, DType::F32);
    const auto part = [&](std::int64_t from, std::int64_t n) {
      return TensorView(buf.data_ptr<float>() + from, DType::F32, {n}, buf.device());
    };
    expect_error([&] { c.all_to_all(buf, buf); }, ErrorCode::InvalidArgument,
                 {"all_to_all: output f32[12] cpu overlaps input f32[12] cpu",
                  "all_to_all has no in-place form: give 'output' its own memory"});
    expect_error([&] { c.send_recv(part(0, 4), 1 - c.rank(), part(2, 4), 1 - c.rank()); },
                 ErrorCode::InvalidArgument, {"send_recv: recv_tensor", "overlaps send_tensor"});

    expect_error([&] { c.all_to_all(part(0, 8), part(4, 8)); }, ErrorCode::InvalidArgument,
                 {"all_to_all: output", "overlaps input"});
    const std::int64_t own = 4 * c.rank(), other = 4 * (1 - c.rank());
    expect_error([&] { c.all_gather(part(other, 4), part(0, 8)); }, ErrorCode::InvalidArgument,
                 {"all_gather: input", "overlaps output",
                  "other than as this rank's block (from "
                  "element " +
                      std::to_string(own)});
    expect_error([&] { c.reduce_scatter(part(0, 8), part(other + 1, 4)); },
                 ErrorCode::InvalidArgument, {"reduce_scatter: output", "overlaps input"});
    expect_error(
        [&] {
          c.all_gather(part(2 * (1 - c.rank()), 2), part(0, 4), {2, 2});
        },
        ErrorCode::InvalidArgument, {"all_gather: input", "overlaps output"});
    for (std::int64_t i = 0; i < 8; ++i) buf.data_ptr<float>()[i] = static_cast<float>(i);
    c.reduce_scatter(part(0, 8), part(own, 4)).wait();  // in place: the sum of both ranks' block
    for (std::int64_t i = 0; i < 4; ++i)
      EXPECT_EQ(buf.data_ptr<float>()[own + i], 2.0f * static_cast<float>(own + i));
    c.all_gather(part(own, 4), part(0, 8)).wait();  // in place: every rank's block
    for (std::int64_t i = 0; i < 8; ++i) EXPECT_EQ(buf.data_ptr<float>()[i], 2.0f * i);
    // The stream is on the tensors' device, or the call fails: no stream is relabelled (a view
    // labelled cuda:0 is enough, the check comes before any backend).
    const TensorView on_cuda(t.view().data(), t.dtype(), t.shape(), Device{DeviceType::CUDA, 0});
    expect_error([&] { c.all_reduce(on_cuda); }, ErrorCode::DeviceMismatch,
                 {"all_reduce", "the stream is on cpu but the tensors on cuda:0"});
    expect_error(
        [&] {
          c.all_reduce(t, ReduceOp::Sum, Stream{Device{DeviceType::CUDA, 0}});
        },
        ErrorCode::DeviceMismatch, {"the stream is on cuda:0 but the tensors on cpu"});
#ifndef MESHFUSE_WITH_CUDA
    // Without CUDA, local serves only CPU tensors.
    expect_error([&] { c.all_reduce(on_cuda, ReduceOp::Sum, Stream{on_cuda.device()}); },
                 ErrorCode::BackendUnavailable, {"'cpu:local' has no backend for cuda"});
#endif
    c.barrier().wait();  // still in step
  });
}

// The root's side of gather and scatter (only it holds both): a team of one, so that no other
// rank waits in the collective the root refuses.
TEST(DistLocal, GatherAndScatterRefuseAnOverlapAtTheRoot) {
  run_local(1, [](Communicator& c) {
    Tensor buf = Tensor::zeros({6}, DType::F32);
    const auto part = [&](std::int64_t from) {
      return TensorView(buf.data_ptr<float>() + from, DType::F32, {4}, buf.device());
    };
    expect_error([&] { c.gather(part(0), part(2), 0); }, ErrorCode::InvalidArgument,
                 {"gather: input", "overlaps output", "gather has no in-place form"});
    expect_error([&] { c.scatter(part(2), part(0), 0); }, ErrorCode::InvalidArgument,
                 {"scatter: output", "overlaps input"});
  });
}

TEST(DistLocal, ARecvWithoutASendTimesOutAndASizeMismatchFails) {
  std::atomic<bool> timed_out = false;  // rank 1 stays until then: a returned rank fails it at once
  run_local(2, [&](Communicator& c) {
    Tensor t = Tensor::zeros({4}, DType::F32);
    if (c.rank() == 0) {
      expect_error([&] { c.recv(t, 1, 7).wait(50ms); }, ErrorCode::Timeout,
                   {"recv f32 x 4", "from 1", "not finished after 50 ms"});
      timed_out = true;
    } else {
      while (!timed_out) std::this_thread::sleep_for(1ms);
    }
  });
  run_local(2, [](Communicator& c) {
    if (c.rank() == 0)
      c.send(Tensor::zeros({4}, DType::F32), 1).wait();
    else
      expect_error([&] { c.recv(Tensor::zeros({2}, DType::F32), 0).wait(); },
                   ErrorCode::CommunicationFailure, {"recv of 8 bytes matched a send of 16 bytes"});
  });
}

// A peer that never joins: gloo's set-up gives up at the communicator's timeout, not at the
// store's (a minute here; five by default).
TEST(DistGloo, SetUpWaitsForAMissingPeerOnlyTheCommunicatorsTimeout) {
  if (!communicator_backend_built(CommunicatorBackend::Gloo)) GTEST_SKIP() << "no gloo backend";
  LaunchInfo launch;
  launch.world_size = launch.local_world_size = 2;
  CommOptions options{"cpu:gloo"};
  options.timeout = 300ms;
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { init_communicator(launch, std::make_shared<HashStore>(60s), options); },
               ErrorCode::Timeout,
               {"communicator world: the gloo backend's set-up on rank 0 of 2 gave up waiting for "
                "its peers after 300 ms",
                "'world/gloo/1' not set"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);  // the store's is 60 s
}

TEST(DistLocal, TheLocalBackendIsOnlyForThreadsOfOneProcess) {
  expect_error([] { LocalWorld world(2, CommOptions{"gloo"}); }, ErrorCode::InvalidArgument,
               {"not local"});
  LaunchInfo launch;
  expect_error([&] { init_communicator(launch, nullptr, CommOptions{"local"}); },
               ErrorCode::InvalidArgument, {"LocalWorld"});
  LocalWorld cpu_only(1, CommOptions{"cpu:local"});
  EXPECT_EQ(cpu_only.communicator(0)->spec().str(), "cpu:local");
  LocalWorld world(2);
  world.communicator(1);
  expect_error([&] { world.communicator(1); }, ErrorCode::InvalidArgument, {"already taken"});
}

// A longer timeout set after the backend was set up applies to its own transfers too (local's
// meetings kept the one of its set-up, and failed a peer 2 s late after 1 s). Checks off: with
// them on, the metadata exchange, which always took the current timeout, waits for the peer.
TEST(DistLocal, SetTimeoutAfterTheBackendIsSetUpAppliesToItsTransfers) {
  CommOptions options;
  options.timeout = std::chrono::seconds(1);  // room for a late thread's start under ASan
  options.check = false;
  run_local(
      2,
      [](Communicator& c) {
        c.barrier().wait();  // the backend set up with 1 s
        c.set_timeout(std::chrono::seconds(20));
        if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(2));
        Tensor t = Tensor::zeros({4}, DType::F32);
        c.all_reduce(t).wait();
      },
      options);
  // A timeout past a year overflowed now + timeout, failing every wait at once.
  CommOptions forever;
  forever.timeout = std::chrono::milliseconds::max();
  expect_error([&] { LocalWorld(2, forever); }, ErrorCode::InvalidArgument,
               {"LocalWorld: timeout", "at most a year"});
}

// in_flight: true while the backend may still touch the tensors, false once it is done with them.
TEST(DistLocal, AWorkIsInFlightUntilItsTransferHasEnded) {
  CommOptions options;
  options.check = false;  // the call returns before the late rank arrives
  std::atomic<bool> looked = false;  // rank 1 calls only once rank 0 has looked
  run_local(
      2,
      [&](Communicator& c) {
        Tensor t = Tensor::zeros({4}, DType::F32);
        if (c.rank() == 1) {
          while (!looked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        Work w = c.all_reduce(t);
        if (c.rank() == 0) {
          EXPECT_TRUE(w.in_flight());
          looked = true;
        }
        w.wait();
        EXPECT_FALSE(w.in_flight());
        EXPECT_FALSE(Work().in_flight());
      },
      options);
}

TEST(DistLocal, AnExceptionFromPollAbortsTheWaitingRanksAndIsRethrown) {
  // Both ranks wait in a collective that can never complete (rank 1 waits for a message): poll
  // (Python's Ctrl-C check) throwing must end them at once, not after the timeout.
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  std::vector<std::string> seen(2);
  int polls = 0;
  const auto start = std::chrono::steady_clock::now();
  expect_error(
      [&] {
        run_local(
            2,
            [&](const std::shared_ptr<Communicator>& c) {
              try {
                if (c->rank() == 0)
                  c->barrier().wait();
                else
                  c->recv(Tensor::zeros({4}, DType::F32), 0).wait();
              } catch (const Error& e) {
                seen[static_cast<std::size_t>(c->rank())] = e.what();
                throw;
              }
            },
            options,
            [&] {
              if (++polls == 3) fail(ErrorCode::Internal, "interrupted by the test");
            });
      },
      ErrorCode::Internal, {"interrupted by the test"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(polls, 3);
  for (const std::string& e : seen) {
    EXPECT_NE(e.find("[communication failure]"), std::string::npos) << e;
    EXPECT_NE(e.find("local: run_local was interrupted"), std::string::npos) << e;
  }
}

// A rank whose function returned can join no collective: the others waited out their timeout
// (300 s by default). Teams without it go on, and what it sent before returning is received.
TEST(DistLocal, ARankThatReturnedFailsTheCollectivesThatNeedItAtOnce) {
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  std::vector<std::string> seen(3);
  std::vector<float> received;
  const auto start = std::chrono::steady_clock::now();
  run_local(
      3,
      [&](const std::shared_ptr<Communicator>& c) {
        const auto pair = c->split(c->rank() == 0 ? 0 : 1, c->rank());
        if (c->rank() == 0) {
          c->send(full({2}, DType::F32, 7.0), 1).wait();
          return;
        }
        Tensor t = full({2}, DType::F32, 1.0);
        pair->all_reduce(t).wait();  // ranks 1 and 2: no rank 0 needed
        EXPECT_EQ(t.data_ptr<float>()[0], 2.0f);
        if (c->rank() == 1) {
          Tensor got = Tensor::zeros({2}, DType::F32);
          c->recv(got, 0).wait();
          received.assign(got.data_ptr<float>(), got.data_ptr<float>() + 2);
        }
        try {
          c->all_reduce(t).wait();
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::CommunicationFailure) << e.what();
          seen[static_cast<std::size_t>(c->rank())] = e.what();
        }
      },
      options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(received, (std::vector<float>{7.0f, 7.0f}));
  for (int r : {1, 2})
    EXPECT_NE(seen[static_cast<std::size_t>(r)].find(
                  "rank 0 has returned from its run_local function: a collective or recv that "
                  "needs it cannot complete"),
              std::string::npos)
        << seen[static_cast<std::size_t>(r)];
}

TEST(DistLocal, ARankThatThrowsStopsTheOthersWaitingAndItsErrorIsRethrown) {
  // Ranks 0 and 1 wait in an all_reduce for rank 2, which throws instead: they used to wait out
  // the whole timeout, and run_local then rethrew rank 0's timeout rather than rank 2's error.
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  std::vector<std::string> others(2);
  const auto start = std::chrono::steady_clock::now();
  expect_error(
      [&] {
        run_local(
            3,
            [&](Communicator& c) {
              if (c.rank() == 2) fail(ErrorCode::Internal, "rank {} failed", c.rank());
              try {
                c.all_reduce(Tensor::zeros({4}, DType::F32)).wait();
              } catch (const Error& e) {
                others[static_cast<std::size_t>(c.rank())] = e.what();
                throw;
              }
            },
            options);
      },
      ErrorCode::Internal, {"rank 2 failed"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  for (const std::string& e : others) {
    EXPECT_NE(e.find("[communication failure]"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 2 of run_local raised: [internal error] rank 2 failed"),
              std::string::npos)
        << e;
  }
  // A LocalWorld aborted by hand refuses later collectives and receives with the reason, at once
  // (the peer never comes).
  LocalWorld world(2);
  const std::shared_ptr<Communicator> c = world.communicator(0);
  world.abort("stopped by the test");
  expect_error([&] { c->all_reduce(Tensor::zeros({2}, DType::F32)).wait(); },
               ErrorCode::CommunicationFailure, {"stopped by the test"});
  const Tensor buffer = Tensor::zeros({2}, DType::F32);
  expect_error([&] { c->recv(buffer, 1).wait(); }, ErrorCode::CommunicationFailure,
               {"stopped by the test"});
}

// --- names and specs
// ------------------------------------------------------------------------------

TEST(DistNames, BackendsReduceOpsAndOpsRoundTripThroughTheirNames) {
  for (auto b : {CommunicatorBackend::Local, CommunicatorBackend::Gloo, CommunicatorBackend::Mpi,
                 CommunicatorBackend::Nccl})
    EXPECT_EQ(parse_communicator_backend(to_string(b)), b);
  for (ReduceOp op : dist::kReduceOps) EXPECT_EQ(parse_reduce_op(to_string(op)), op);
  EXPECT_EQ(parse_reduce_op("MEAN"), ReduceOp::Avg);
  EXPECT_EQ(parse_comm_op("reduce_scatter"), CommOp::ReduceScatter);
  expect_error([] { parse_communicator_backend("ucc"); }, ErrorCode::InvalidArgument,
               {"'ucc'", "local, gloo, mpi, nccl"});
  EXPECT_TRUE(communicator_backend_built(CommunicatorBackend::Local));
}

TEST(DistNames, TheNcclLibraryIsOpenedAtRunTimeAndNamesItsVersion) {
  if (!communicator_backend_built(CommunicatorBackend::Nccl)) {
    try {
      nccl_library();
      FAIL() << "nccl_library() without the nccl backend";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::BackendUnavailable);
      EXPECT_NE(std::string(e.what()).find("not in this build"), std::string::npos) << e.what();
    }
    return;
  }
  // No GPU needed: dlopen, every symbol found, ncclGetVersion.
  const std::string library = nccl_library();
  EXPECT_TRUE(library.starts_with("NCCL 2.")) << library;
  EXPECT_NE(library.find("libnccl"), std::string::npos) << library;
}

TEST(DistNames, BackendSpecsMapDeviceTypesToBackends) {
  EXPECT_EQ(BackendSpec::parse("").str(), "cpu:gloo,cuda:nccl");
  EXPECT_EQ(BackendSpec::parse("cuda:nccl, cpu:mpi").str(), "cpu:mpi,cuda:nccl");
  EXPECT_EQ(BackendSpec::parse("gloo").str(), "cpu:gloo");
  EXPECT_EQ(BackendSpec::parse("NCCL").str(), "cuda:nccl");
#ifdef MESHFUSE_WITH_CUDA
  EXPECT_EQ(BackendSpec::parse("local").str(), "cpu:local,cuda:local");
  EXPECT_EQ(BackendSpec::parse("cuda:local").str(), "cuda:local");
#else
  EXPECT_EQ(BackendSpec::parse("local").str(), "cpu:local");
  expect_error([] { BackendSpec::parse("cuda:local"); }, ErrorCode::InvalidArgument,
               {"local cannot serve cuda tensors"});
#endif
  EXPECT_EQ(BackendSpec::parse("cpu:mpi").for_device(DeviceType::CPU), CommunicatorBackend::Mpi);
  expect_error([] { BackendSpec::parse("cuda:gloo"); }, ErrorCode::InvalidArgument,
               {"gloo cannot serve cuda tensors"});
  expect_error([] { BackendSpec::parse("cpu:gloo,cpu:mpi"); }, ErrorCode::InvalidArgument,
               {"cpu is listed twice"});
  expect_error([] { BackendSpec::parse("cpu=gloo,cuda:nccl"); }, ErrorCode::InvalidArgument,
               {"'cpu=gloo' is not device:backend"});
  expect_error([] { BackendSpec::parse("gloo").for_device(DeviceType::CUDA); },
               ErrorCode::BackendUnavailable, {"no backend for cuda tensors"});
}

// --- launch environment
// ---------------------------------------------------------------------------

TEST(DistBootstrap, TorchrunVariablesGiveRanksAndTheMaster) {
  const LaunchInfo info = parse_launch_env({{"RANK", "5"},
                                            {"WORLD_SIZE", "8"},
                                            {"LOCAL_RANK", "1"},
                                            {"LOCAL_WORLD_SIZE", "4"},
                                            {"MASTER_ADDR", "10.0.0.1"},
                                            {"MASTER_PORT", "29500"}});
  EXPECT_EQ(info.launcher, Launcher::Torchrun);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.cuda_device(), 1);  // the local rank, not the global one
  EXPECT_EQ(info.str(), "torchrun rank 5/8 (local 1/4), master 10.0.0.1:29500");
}

TEST(DistBootstrap, OpenMpiAndSlurmVariablesGiveRanks) {
  const LaunchInfo mpi = parse_launch_env({{"OMPI_COMM_WORLD_RANK", "3"},
                                           {"OMPI_COMM_WORLD_SIZE", "4"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(mpi.launcher, Launcher::OpenMpi);
  EXPECT_EQ(mpi.str(), "openmpi rank 3/4 (local 1/2)");
  const LaunchInfo slurm = parse_launch_env({{"SLURM_PROCID", "6"},
                                             {"SLURM_NTASKS", "8"},
                                             {"SLURM_LOCALID", "2"},
                                             {"SLURM_TASKS_PER_NODE", "4(x2)"}});
  EXPECT_EQ(slurm.str(), "slurm rank 6/8 (local 2/4)");
  // Uneven nodes: this node's entry (SLURM_NODEID), not the first one.
  const auto on_node = [](const char* tasks, const char* node, const char* rank,
                          const char* local) {
    return parse_launch_env({{"SLURM_PROCID", rank},
                             {"SLURM_NTASKS", "11"},
                             {"SLURM_LOCALID", local},
                             {"SLURM_NODEID", node},
                             {"SLURM_TASKS_PER_NODE", tasks}})
        .str();
  };
  EXPECT_EQ(on_node("3,5,3", "1", "7", "4"), "slurm rank 7/11 (local 4/5)");
  EXPECT_EQ(on_node("4(x2),3", "2", "10", "2"), "slurm rank 10/11 (local 2/3)");
  EXPECT_EQ(on_node("4(x2),3", "1", "5", "1"), "slurm rank 5/11 (local 1/4)");
  // --ntasks-per-node: one number for every node.
  EXPECT_EQ(parse_launch_env({{"SLURM_PROCID", "5"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NODEID", "1"},
                              {"SLURM_NTASKS_PER_NODE", "4"},
                              {"SLURM_TASKS_PER_NODE", "4(x2)"}})
                .str(),
            "slurm rank 5/8 (local 1/4)");
  EXPECT_EQ(parse_launch_env({}).str(), "none rank 0/1 (local 0/1)");
  // torchrun wins over the launcher around it.
  EXPECT_EQ(parse_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"SLURM_PROCID", "3"}}).launcher,
            Launcher::Torchrun);
}

TEST(DistBootstrap, MissingOrInconsistentVariablesNameTheVariable) {
  expect_error(
      [] {
        parse_launch_env({{"RANK", "1"}});
      },
      ErrorCode::InvalidArgument, {"RANK is set but WORLD_SIZE is missing"});
  expect_error(
      [] {
        parse_launch_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}});
      },
      ErrorCode::InvalidArgument, {"RANK=4 is not below WORLD_SIZE=4"});
  expect_error(
      [] {
        parse_launch_env({{"RANK", "1"}, {"WORLD_SIZE", "4"}});
      },
      ErrorCode::InvalidArgument, {"LOCAL_RANK is missing", "local rank"});
  expect_error(
      [] {
        parse_launch_env({{"RANK", "x"}, {"WORLD_SIZE", "4"}});
      },
      ErrorCode::InvalidArgument, {"RANK='x' is not a non-negative integer"});
  expect_error(
      [] {
        parse_launch_env(
            {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
      },
      ErrorCode::InvalidArgument, {"local rank 2 of 2"});
  expect_error(
      [] {
        parse_launch_env({{"MASTER_ADDR", "h"}});
      },
      ErrorCode::InvalidArgument, {"MASTER_ADDR is set but MASTER_PORT is missing"});
  expect_error(
      [] {
        parse_launch_env({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
      },
      ErrorCode::InvalidArgument, {"MASTER_PORT=70000 is outside 1..65535"});
}

// --- stores
// ---------------------------------------------------------------------------------------

// A value set by one thread is seen by another that waits for it; a missing key times out.
void check_store(Store& writer, Store& reader) {
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    writer.set("a/b c", std::string("value\0with nul", 14));
  });
  EXPECT_EQ(reader.get_string("a/b c"), std::string("value\0with nul", 14));
  t.join();
  EXPECT_TRUE(reader.check({"a/b c"}));
  EXPECT_FALSE(reader.check({"a/b c", "missing"}));
  writer.set("empty", Store::Bytes{});
  EXPECT_TRUE(reader.get("empty").empty());
  reader.set_timeout(30ms);
  expect_error([&] { reader.get("missing"); }, ErrorCode::Timeout, {"'missing'"});
  expect_error([&] { reader.wait({"a/b c", "missing"}, 30ms); }, ErrorCode::Timeout, {"'missing'"});
}

TEST(DistStore, HashStoreSharesValuesBetweenThreads) {
  HashStore store;
  check_store(store, store);
}

TEST(DistStore, FileStoreSharesValuesThroughADirectory) {
  const std::string dir = ::testing::TempDir() + "meshfuse_filestore_" +
                          std::to_string(::testing::UnitTest::GetInstance()->random_seed());
  std::filesystem::remove_all(dir);
  FileStore a(dir), b(dir);
  check_store(a, b);
  std::filesystem::remove_all(dir);
}

// Whoever else can read or write the directory could read or plant the job's keys; a symbolic
// link could be pointed elsewhere after the check.
TEST(DistStore, AFileStoreDirectoryOthersCanReachOrALinkIsRefused) {
  namespace fs = std::filesystem;
  const fs::path dir = ::testing::TempDir() + "meshfuse_filestore_private_" +
                       std::to_string(::testing::UnitTest::GetInstance()->random_seed());
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const fs::perms others : {fs::perms::group_read, fs::perms::others_exec}) {
    fs::permissions(dir, fs::perms::owner_all | others);
    expect_error([&] { FileStore store(dir.string()); }, ErrorCode::InvalidArgument,
                 {"nobody else can read or write"});
  }
  fs::permissions(dir, fs::perms::owner_all);
  FileStore(dir.string()).set("k", std::string("v"));
  const fs::path link = dir.string() + "_link";
  fs::remove(link);
  fs::create_directory_symlink(dir, link);
  expect_error([&] { FileStore store(link.string()); }, ErrorCode::InvalidArgument,
               {"not a symbolic link"});
  fs::remove(link);
  fs::remove_all(dir);
}

// Ranks making the store's directory at once: it was made 0755 and then narrowed, and a rank that
// found it in between refused it ("got mode 755", about 1 in 60 jobs of 8 processes).
TEST(DistStore, RanksMakingTheFileStoreDirectoryAtOnceAllAcceptIt) {
  namespace fs = std::filesystem;
  const fs::path base = ::testing::TempDir() + "meshfuse_filestore_race_" +
                        std::to_string(::testing::UnitTest::GetInstance()->random_seed());
  fs::remove_all(base);
  for (int trial = 0; trial < 30; ++trial) {
    const std::string dir = (base / std::to_string(trial) / "store").string();
    std::atomic<int> refused{0}, ready{0};
    std::vector<std::thread> ranks;
    for (int r = 0; r < 8; ++r)
      ranks.emplace_back([&] {
        for (++ready; ready < 8;) std::this_thread::yield();
        try {
          FileStore store(dir);
        } catch (const Error&) {
          ++refused;
        }
      });
    for (std::thread& t : ranks) t.join();
    ASSERT_EQ(refused, 0) << "trial " << trial;
    EXPECT_EQ(fs::status(dir).permissions() & (fs::perms::group_all | fs::perms::others_all),
              fs::perms::none);
  }
  fs::remove_all(base);
}

// Whoever controls a directory above the store's could move it away after the check and put
// their own at its path: the store keeps reading and writing the directory it checked.
TEST(DistStore, AFileStoreKeepsToTheDirectoryItCheckedWhenAnotherTakesItsPath) {
  namespace fs = std::filesystem;
  const fs::path dir = ::testing::TempDir() + "meshfuse_filestore_swap_" +
                       std::to_string(::testing::UnitTest::GetInstance()->random_seed());
  const fs::path moved = dir.string() + "_moved";
  fs::remove_all(dir);
  fs::remove_all(moved);
  FileStore store(dir.string());
  store.set("before", std::string("1"));
  fs::rename(dir, moved);
  fs::create_directories(dir);  // the stranger's, open to all
  fs::permissions(dir, fs::perms::all);
  store.set("after", std::string("2"));
  EXPECT_TRUE(fs::exists(moved / "after"));
  EXPECT_FALSE(fs::exists(dir / "after"));
  std::ofstream(dir / "planted") << "from the stranger";
  EXPECT_FALSE(store.check({"planted"}));
  EXPECT_EQ(store.get_string("before"), "1");
  fs::remove_all(dir);
  fs::remove_all(moved);
}

// A store directory used by one job, then by the next: the second must not read the first's keys
// (gloo's rank addresses, bootstrap keys), which made it hang or connect to dead ranks.
TEST(DistStore, AFileStoreDirectoryReusedByALaterJobHoldsNoneOfItsKeys) {
  const std::string dir = ::testing::TempDir() + "meshfuse_filestore_jobs_" +
                          std::to_string(::testing::UnitTest::GetInstance()->random_seed());
  std::filesystem::remove_all(dir);
  ::setenv("MESHFUSE_STORE_PATH", dir.c_str(), 1);
  ::setenv("MESHFUSE_STORE_SECRET", "the first job", 1);
  store_from_env(LaunchInfo{})->set("world/gloo/rank_0", std::string("an old address"));
  EXPECT_TRUE(store_from_env(LaunchInfo{})->check({"world/gloo/rank_0"}));  // the same job
  ::setenv("MESHFUSE_STORE_SECRET", "the second job", 1);
  EXPECT_FALSE(store_from_env(LaunchInfo{})->check({"world/gloo/rank_0"}));
  // One exported secret for every job (and a static torchrun's run id "none"): a run id apart.
  ::setenv("MESHFUSE_RUN_ID", "run 2", 1);
  EXPECT_FALSE(store_from_env(LaunchInfo{})->check({"world/gloo/rank_0"}));
  ::unsetenv("MESHFUSE_RUN_ID");
  ::unsetenv("MESHFUSE_STORE_SECRET");
  ::unsetenv("MESHFUSE_STORE_PATH");
  std::filesystem::remove_all(dir);
}

// Two jobs that share an exported secret and a fixed port: the second's rank 0 cannot bind, and
// its rank 1 used to join the first job as its rank 1 (their all_reduce summed both jobs' data).
// The job identity (here meshfuse launch's per-launch id) is proven with the secret.
TEST(DistStore, ARankOfAnotherJobThatSharesTheSecretAndPortIsRefused) {
  ::setenv("MESHFUSE_STORE_SECRET", "one secret for every job", 1);
  ::setenv("MESHFUSE_LAUNCH_ID", "job a", 1);
  LaunchInfo launch;
  launch.master_addr = "127.0.0.1";
  launch.world_size = 2;
  const std::shared_ptr<Store> a0 = store_from_env(launch, 5s);
  launch.master_port = dynamic_cast<TcpStore&>(*a0).port();
  launch.rank = 1;
  a0->set("world/gloo/rank_0", std::string("job a's rank 0"));
  ::setenv("MESHFUSE_LAUNCH_ID", "job b", 1);
  expect_error([&] { store_from_env(launch, 5s); }, ErrorCode::CommunicationFailure,
               {"did not prove this job's secret", "another job's with the same secret"});
  ::setenv("MESHFUSE_LAUNCH_ID", "job a", 1);
  EXPECT_EQ(store_from_env(launch, 5s)->get_string("world/gloo/rank_0"), "job a's rank 0");
  // The same job after an elastic restart that this rank's agent counted and rank 0's did not:
  // the restart count is no part of the identity.
  ::setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  EXPECT_TRUE(store_from_env(launch, 5s)->check({"world/gloo/rank_0"}));
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  ::unsetenv("MESHFUSE_LAUNCH_ID");
  ::unsetenv("MESHFUSE_STORE_SECRET");
}

TEST(DistStore, NoPortPastTheLastBesideTorchrunsAgentStore) {
  // MASTER_PORT + 1 = 65536 wrapped to port 0 (any): rank 0 served where nobody looked.
  LaunchInfo launch;
  launch.master_addr = "127.0.0.1";
  launch.master_port = 65535;
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  expect_error([&] { store_from_env(launch, 100ms); }, ErrorCode::InvalidArgument,
               {"MASTER_PORT is 65535"});
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
}

constexpr const char* kSecret = "the job's secret";

// The IPv4 address a TCP socket listens on at `port`, from /proc/net/tcp ("" when none).
std::string listening_address(int port) {
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);  // the header
  while (std::getline(tcp, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    const std::size_t colon = local.find(':');
    if (state != "0A" || std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
    in_addr a{};
    a.s_addr = static_cast<in_addr_t>(std::stoul(local.substr(0, colon), nullptr, 16));
    return ::inet_ntoa(a);
  }
  return "";
}

// Loopback said another way than "localhost" / "127.x" was taken for a host name that resolves to
// loopback, and the store opened every interface.
TEST(DistStore, ALoopbackNameInAnyFormServesOnLoopbackOnly) {
  for (const char* name : {"LOCALHOST", "2130706433", "127.1"}) {
    TcpStore server(name, 0, true, kSecret, 5s);
    EXPECT_EQ(listening_address(server.port()), "127.0.0.1") << name;
  }
}

TEST(DistStore, TcpStoreServesItsClientsAndPrefixStoresKeepTeamsApart) {
  TcpStore server("127.0.0.1", 0, true, kSecret, 5s);  // port 0: the kernel picks a free one
  TcpStore client("127.0.0.1", server.port(), false, kSecret, 5s);
  check_store(server, client);
  auto shared = std::make_shared<TcpStore>("127.0.0.1", server.port(), false, kSecret, 5s);
  PrefixStore team1("team1", shared), team2("team2", shared);
  team1.set("k", std::string("one"));
  team2.set("k", std::string("two"));
  EXPECT_EQ(team1.get_string("k"), "one");
  EXPECT_EQ(client.get_string("team2/k"), "two");
}

// A child forked while the store is open (os.fork, an MPI singleton's orted) holds copies of its
// sockets; the store still closes at once instead of waiting for the child to exit.
TEST(DistStore, TcpStoreClosesAtOnceWhileAForkedChildLives) {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, kSecret, 20s);
  auto client = std::make_unique<TcpStore>("127.0.0.1", server->port(), false, kSecret, 20s);
  client->set("k", std::string("v"));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::sleep(10);
    ::_exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  client.reset();
  server.reset();
  const auto took = std::chrono::steady_clock::now() - start;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_LT(took, 8s);  // the child lives 10 s
}

TEST(DistStore, TcpStoreClientGivesUpWhenNoServerAnswers) {
  expect_error([] { TcpStore("127.0.0.1", 1, false, kSecret, 100ms); },
               ErrorCode::CommunicationFailure, {"cannot reach 127.0.0.1:1"});
}

TEST(DistStore, TcpStoreNeedsASecretAndAnAddressOfThisMachine) {
  expect_error([] { TcpStore("127.0.0.1", 0, true, "", 100ms); }, ErrorCode::InvalidArgument,
               {"secret", "got 0 bytes"});
  // 192.0.2.1 (TEST-NET-1, RFC 5737) is no interface of this machine.
  expect_error([] { TcpStore("192.0.2.1", 0, true, kSecret, 100ms); },
               ErrorCode::CommunicationFailure,
               {"cannot serve on 192.0.2.1", "MESHFUSE_STORE_BIND=0.0.0.0"});
}

// A socket on 127.0.0.1 (port 0: a free one), listening (connects succeed) or connected to `port`.
int local_socket(int port, bool listen) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  auto* a = reinterpret_cast<sockaddr*>(&addr);
  EXPECT_EQ(listen ? ::bind(fd, a, sizeof(addr)) + ::listen(fd, 4) : ::connect(fd, a, sizeof(addr)),
            0);
  return fd;
}

int port_of(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

// Sends `bytes` on fd, then reads what comes back until the server hangs up (or 2 s pass).
std::string exchange_raw(int fd, const std::string& bytes) {
  EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
  const timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  char buf[256];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) got.append(buf, static_cast<std::size_t>(n));
  return got;
}

template <typename T>
std::string raw(T v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
}

// HMAC-SHA256(key, label || client nonce || server nonce): an end's proof in the handshake
// (tcp_store.cpp's protocol comment).
std::string proof_of(const std::string& key, const std::string& label, const std::string& client,
                     const std::string& server, const std::string& job = "") {
  const auto job_len = static_cast<std::uint32_t>(job.size());
  const std::string message =
      label + std::string(reinterpret_cast<const char*>(&job_len), sizeof(job_len)) + job + client +
      server;
  unsigned char mac[32];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &len);
  return std::string(reinterpret_cast<const char*>(mac), len);
}

constexpr std::uint32_t kHello = 0x3253464d;  // "MFS2"

// Reads n bytes (or fewer if the server hangs up or 2 s pass).
std::string read_raw(int fd, std::size_t n) {
  const timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  char buf[256];
  for (ssize_t r;
       got.size() < n && (r = ::recv(fd, buf, std::min(sizeof(buf), n - got.size()), 0)) > 0;)
    got.append(buf, static_cast<std::size_t>(r));
  return got;
}

// The client's side of the handshake on a raw socket, proving `secret`: whether it was welcomed.
bool prove(int fd, const std::string& secret) {
  const std::string mine(32, 'n');  // any nonce
  const std::string hello = raw(kHello) + mine;
  ::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
  const std::string challenge = read_raw(fd, 65);
  if (challenge.size() != 65 || challenge[0] != 3) return false;
  const std::string theirs = challenge.substr(1, 32);
  EXPECT_EQ(challenge.substr(33), proof_of(kSecret, "meshfuse store server", mine, theirs))
      << "the job's server proves the job's secret";
  const std::string ours = proof_of(secret, "meshfuse store client", mine, theirs);
  ::send(fd, ours.data(), ours.size(), MSG_NOSIGNAL);
  return read_raw(fd, 1) == "\x01";
}

// A GET of key: [u8 2][u32 length][key].
std::string get_request(const std::string& key) {
  return raw(std::uint8_t{2}) + raw(static_cast<std::uint32_t>(key.size())) + key;
}

// A SET: [u8 1][u32 length][key][u64 length][value].
std::string set_request(const std::string& key, const std::string& value) {
  return raw(std::uint8_t{1}) + raw(static_cast<std::uint32_t>(key.size())) + key +
         raw(static_cast<std::uint64_t>(value.size())) + value;
}

TEST(DistStore, TcpStoreLetsNoStrangerReadOrChangeAKey) {
  TcpStore server("127.0.0.1", 0, true, kSecret, 5s);
  server.set("nccl_id", std::string("the job's id"));
  const std::vector<std::pair<std::string, std::string>> strangers = {
      {"no hello", get_request("nccl_id")},
      {"no hello, a set", set_request("nccl_id", "forged")},
      {"the old hello, the secret in the clear",
       raw(std::uint32_t{0x3153464d}) + raw(static_cast<std::uint32_t>(std::strlen(kSecret))) +
           kSecret + get_request("nccl_id")},
  };
  for (const auto& [who, bytes] : strangers) {
    const int fd = local_socket(server.port(), false);
    EXPECT_EQ(exchange_raw(fd, bytes), "") << who << ": the server answers nothing and hangs up";
    ::close(fd);
  }
  for (const std::string& guess :
       {std::string("guess"), std::string("the job"), std::string(kSecret) + "!"}) {
    const int fd = local_socket(server.port(), false);
    EXPECT_FALSE(prove(fd, guess)) << guess;
    char byte = 0;
    EXPECT_EQ(::recv(fd, &byte, 1, 0), 0) << guess << ": the server hangs up";  // 2 s: read_raw's
    ::close(fd);
  }
  EXPECT_EQ(server.get_string("nccl_id"), "the job's id");
  // The job's own raw client, for contrast: welcomed, the key read.
  const int fd = local_socket(server.port(), false);
  ASSERT_TRUE(prove(fd, kSecret));
  const std::string got =
      exchange_raw(fd, get_request("nccl_id") + raw(std::uint8_t{7}) + raw(std::uint32_t{0}));
  ::close(fd);
  EXPECT_EQ(got, std::string("\x01", 1) + raw(std::uint64_t{12}) + "the job's id");
  // A client of the library with another secret finds that the server cannot prove it.
  expect_error([&] { TcpStore("127.0.0.1", server.port(), false, "guess", 5s); },
               ErrorCode::CommunicationFailure, {"did not prove this job's secret"});
}

// A process that took the port first (or any server without the secret) learns nothing of it:
// the client sends its hello and nonce, finds no proof of the secret (a wrong one, or a bare
// welcome, which a client once took) and stops.
TEST(DistStore, TcpStoreClientSendsNothingOfTheSecretToAnImpostor) {
  for (const std::string& answer :
       {std::string(1, '\x03') + std::string(64, 'x'), std::string(1, '\x01')}) {
    const int listener = local_socket(0, true);
    std::string heard;
    std::thread impostor([&] {
      const int fd = ::accept(listener, nullptr, nullptr);
      heard = read_raw(fd, 36);
      ::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL);
      heard += read_raw(fd, 1 << 16);  // whatever else comes, until the client hangs up
      ::close(fd);
    });
    expect_error([&] { TcpStore("127.0.0.1", port_of(listener), false, kSecret, 5s); },
                 ErrorCode::CommunicationFailure, {"did not prove this job's secret"});
    impostor.join();
    ::close(listener);
    EXPECT_EQ(heard.size(), 36u) << "the hello and the client's nonce, nothing more";
    EXPECT_EQ(heard.substr(0, 4), raw(kHello));
    EXPECT_EQ(heard.find(kSecret), std::string::npos);
  }
}

// A server that trickles its challenge a byte at a time holds a client no longer than its timeout
// (each read had the whole timeout: 66 of them).
TEST(DistStore, TcpStoreClientGivesUpOnATricklingServerAtItsTimeout) {
  const int listener = local_socket(0, true);
  std::atomic<bool> done{false};
  std::thread trickler([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    read_raw(fd, 36);
    for (int i = 0; i < 65 && !done; ++i) {
      ::send(fd, i == 0 ? "\x03" : "x", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(100ms);
    }
    ::close(fd);
  });
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { TcpStore("127.0.0.1", port_of(listener), false, kSecret, 300ms); },
               ErrorCode::Timeout, {"no answer from", "300 ms"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);  // the trickle lasts 6.5 s
  done = true;
  trickler.join();
  ::close(listener);
}

int open_descriptors() {
  return static_cast<int>(std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                                        std::filesystem::directory_iterator{}));
}

// Strangers who come and go leave nothing behind (their sockets closed, their threads joined),
// one who trickles its hello is dropped at the deadline, and those who hold the slots for
// unproven connections make the job's client wait, not fail.
TEST(DistStore, TcpStoreOutlastsStrangersWhoHoldOrWasteConnections) {
  TcpStore server("127.0.0.1", 0, true, kSecret, 1s);  // unproven connections dropped after 1 s
  const int before = open_descriptors();
  for (int i = 0; i < 300; ++i) {
    const int fd = local_socket(server.port(), false);
    exchange_raw(fd, "garbage");
    ::close(fd);
  }
  EXPECT_LT(open_descriptors(), before + 10) << "the server keeps the strangers' sockets";

  const int slow = local_socket(server.port(), false);
  const auto start = std::chrono::steady_clock::now();
  ::send(slow, "M", 1, MSG_NOSIGNAL);  // a hello that never completes
  char byte = 0;
  EXPECT_EQ(::recv(slow, &byte, 1, 0), 0) << "dropped";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  ::close(slow);

  std::vector<int> holders;
  for (int i = 0; i < 70; ++i) holders.push_back(local_socket(server.port(), false));
  std::this_thread::sleep_for(50ms);  // every holder accepted, the last ones told "busy"
  TcpStore client("127.0.0.1", server.port(), false, kSecret, 5s);
  client.set("k", std::string("in"));
  EXPECT_EQ(server.get_string("k"), "in");
  for (int fd : holders) ::close(fd);
}

// Strangers holding every slot for unproven connections (64) for longer than the job's client
// waits: a new connection makes the oldest of them room, so the client gets in at once (it was
// told "busy" until its deadline, the strangers dropped only after 10 s).
TEST(DistStore, TcpStoreLetsTheJobInPastStrangersHoldingEveryUnprovenSlot) {
  TcpStore server("127.0.0.1", 0, true, kSecret, 60s);
  std::vector<int> holders;
  for (int i = 0; i < 64; ++i) holders.push_back(local_socket(server.port(), false));
  std::this_thread::sleep_for(50ms);
  TcpStore client("127.0.0.1", server.port(), false, kSecret, 3s);
  client.set("k", std::string("in"));
  EXPECT_EQ(server.get_string("k"), "in");
  for (int fd : holders) ::close(fd);
}

// A listener whose backlog is full drops new SYNs: a blocking connect waited out the kernel's SYN
// retries (about two minutes), past the client's timeout.
TEST(DistStore, TcpStoreClientGivesUpAtItsTimeoutWhenTheServersBacklogIsFull) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  std::vector<int> held;  // fill the backlog, never accepted
  for (int i = 0; i < 4; ++i) {
    held.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    sockaddr_in to = addr;
    to.sin_port = htons(static_cast<std::uint16_t>(port_of(listener)));
    ::connect(held.back(), reinterpret_cast<sockaddr*>(&to), sizeof(to));
  }
  std::this_thread::sleep_for(100ms);
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { TcpStore("127.0.0.1", port_of(listener), false, kSecret, 300ms); },
               ErrorCode::CommunicationFailure, {"cannot reach 127.0.0.1", "within 300 ms"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);  // SYN retries: about 2 minutes
  for (int fd : held) ::close(fd);
  ::close(listener);
}

TEST(DistStore, TcpStoreClientTimesOutWhenTheServerNeverAnswers) {
  const int silent = local_socket(0, true);  // accepts connections (backlog), never reads
  expect_error([&] { TcpStore("127.0.0.1", port_of(silent), false, kSecret, 100ms); },
               ErrorCode::Timeout, {"no answer from", "100 ms"});
  ::close(silent);
}

TEST(DistStore, TcpStoreServerHangsUpOnAnOversizedRequestAndServesTheOthers) {
  TcpStore server("127.0.0.1", 0, true, kSecret, 5s);
  const int rogue = local_socket(server.port(), false);
  const std::uint32_t key_len = 0xFFFFFFFF;  // 4 GiB of key
  ASSERT_TRUE(prove(rogue, kSecret));
  EXPECT_EQ(exchange_raw(rogue, raw(std::uint8_t{1}) + raw(key_len)), "") << "the server hangs up";
  ::close(rogue);
  const int unknown = local_socket(server.port(), false);  // a command that does not exist
  ASSERT_TRUE(prove(unknown, kSecret));
  EXPECT_EQ(exchange_raw(unknown, raw(std::uint8_t{9}) + raw(std::uint32_t{0})), "");
  ::close(unknown);
  TcpStore client("127.0.0.1", server.port(), false, kSecret, 5s);
  client.set("k", std::string("v"));
  EXPECT_EQ(server.get_string("k"), "v");
}

// Many clients at once, each setting its key and reading everyone's: none is lost or mixed up,
// while strangers knock at the same time.
TEST(DistStore, TcpStoreServesManyClientsAtOnce) {
  TcpStore server("127.0.0.1", 0, true, kSecret, 10s);
  constexpr int kClients = 32;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int c = 0; c < kClients; ++c)
    threads.emplace_back([&, c] {
      TcpStore client("127.0.0.1", server.port(), false, kSecret, 10s);
      client.set("rank" + std::to_string(c), std::to_string(c * c));
      for (int o = 0; o < kClients; ++o)
        wrong += client.get_string("rank" + std::to_string(o)) != std::to_string(o * o);
    });
  for (int s = 0; s < 8; ++s)
    threads.emplace_back([&] {
      const int fd = local_socket(server.port(), false);
      wrong += prove(fd, "guess");
      ::close(fd);
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(server.get_string("rank0"), "0");
}

TEST(DistStore, StoreSecretComesFromTheEnvironmentOrAPrivateFile) {
  const std::string file = ::testing::TempDir() + "meshfuse_secret_" +
                           std::to_string(::testing::UnitTest::GetInstance()->random_seed());
  ::unsetenv("MESHFUSE_STORE_SECRET");
  ::unsetenv("MESHFUSE_STORE_SECRET_FILE");
  expect_error([] { store_secret_from_env(); }, ErrorCode::InvalidArgument,
               {"no job secret", "MESHFUSE_STORE_SECRET", "meshfuse launch"});
  ::setenv("MESHFUSE_STORE_SECRET_FILE", file.c_str(), 1);
  std::ofstream(file) << "from a file\n";
  std::filesystem::permissions(file, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::group_read);
  expect_error([] { store_secret_from_env(); }, ErrorCode::InvalidArgument,
               {"nobody else can read", "mode 440"});
  std::filesystem::permissions(file, std::filesystem::perms::owner_read);
  EXPECT_EQ(store_secret_from_env(), "from a file");
  ::setenv("MESHFUSE_STORE_SECRET", "from the environment", 1);
  EXPECT_EQ(store_secret_from_env(), "from the environment");
  ::unsetenv("MESHFUSE_STORE_SECRET");
  ::unsetenv("MESHFUSE_STORE_SECRET_FILE");
  std::filesystem::remove(file);
}

}  // namespace
}  // namespace meshfuse::test
