// The communicator suite across processes: every rank of a job runs this binary (started by
// `meshfuse launch -n 4` for gloo, `mpirun -np 4` for mpi) on the backend named by
// MESHFUSE_BACKEND, and checks its own results. A rank that fails exits non-zero, and the
// launcher reports it.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>

#include "dist_cases.h"
#include "executor_cases.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::test {
namespace {

std::shared_ptr<Communicator> world;

// A rank killed (SIGKILL) in the middle of the job: only with MESHFUSE_TEST_KILL_RANK=r and
// MESHFUSE_TEST_KILL_IN=collective|executor (the dist_*_rank_killed tests, which also check that
// the launcher names the dead rank). Rank r dies while a 64 MiB all_reduce, or an executor run of
// the MLP block, is under way; every other rank must raise Timeout or CommunicationFailure
// within the communicator's timeout, and says so on stdout. The survivors ignore the launcher's
// SIGTERM, which would otherwise end them before they could tell.
TEST(DistFault, ARankKilledMidwayGivesEveryOtherRankAnErrorWithinTheTimeout) {
  const char* victim_env = std::getenv("MESHFUSE_TEST_KILL_RANK");
  const char* in_env = std::getenv("MESHFUSE_TEST_KILL_IN");
  if (!victim_env || !in_env) GTEST_SKIP() << "needs MESHFUSE_TEST_KILL_RANK and _IN";
  const int victim = std::atoi(victim_env);
  const std::string in = in_env;
  ASSERT_TRUE(in == "collective" || in == "executor") << in;
  std::signal(SIGTERM, SIG_IGN);
  const auto timeout = std::chrono::seconds(5);
  auto team = world->split(0, world->rank());
  team->set_timeout(timeout);
  team->barrier().wait();
  const std::function<void()> step = [&]() -> std::function<void()> {
    if (in == "collective") {
      auto t = std::make_shared<Tensor>(Tensor::zeros({std::int64_t{1} << 24}, DType::F32));
      return [team, t] { team->all_reduce(*t).wait(); };
    }
    const Program p = exec::mlp_block(true, exec::line(*team));
    const std::vector<Tensor> parts = exec::parts_of(
        p, exec::whole_inputs(exec::mlp_block(false, exec::line(*team))), team->rank());
    auto executor = std::make_shared<MultiDeviceExecutor>(p, team);
    return [executor, parts] { executor->run(exec::views(parts)); };
  }();
  for (int i = 0; i < 3; ++i) step();  // every rank well under way
  if (team->rank() == victim) {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::raise(SIGKILL);
    }).detach();
    for (;;) step();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    for (;;) step();
  } catch (const Error& e) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::CommunicationFailure)
        << e.what();
    EXPECT_LT(s, 2.0 * std::chrono::duration<double>(timeout).count()) << e.what();
    if (::testing::Test::HasFailure()) return;  // expect_rank_killed.sh counts only good reports
    std::printf("rank %d survived rank %d's death in the %s: %s after %.1f s\n", team->rank(),
                victim, in.c_str(), std::string(to_string(e.code())).c_str(), s);
    std::fflush(stdout);
  }
}

// Tests run in file order on every rank; the timeout case comes last.
TEST(DistProcess, EveryCollectiveGivesTheExpectedValuesForEveryDtypeAndShardKind) {
  dist::check_every_collective(*world);
}

TEST(DistProcess, EveryCollectiveWorksWithoutTheMetadataCheck) {
  world->set_checks(false);
  dist::check_every_collective(*world);
  world->set_checks(true);
}

TEST(DistProcess, SeveralOperationsInFlightCompleteInAnyWaitOrder) {
  dist::check_many_in_flight(*world);
}

TEST(DistProcess, SplitAndNewGroupFormSubTeamsThatCommunicate) { dist::check_sub_teams(*world); }

TEST(DistProcess, MeshTeamsAreTheMeshLinesSplitOnceAndKept) { dist::check_mesh_teams(*world); }

TEST(DistProcess, MismatchedCallsFailOnEveryRankNamingTheRanksAndWhatDiffered) {
  if (world->size() != 4) GTEST_SKIP() << "written for 4 ranks";
  dist::check_mismatch(*world);
}

TEST(ExecutorProcess, EveryTransitionOfOneMeshDimensionGivesTheParts) {
  exec::check_every_transition(world);
}

TEST(ExecutorProcess, TensorAndSequenceParallelMlpBlockMatchesOneDevice) {
  exec::check_mlp_block(world);
}

TEST(ExecutorProcess, MlpBlockOnATwoByTwoMeshMatchesOneDevice) {
  exec::check_mlp_block_on_a_2d_mesh(world);
}

TEST(ExecutorProcess, VocabularyParallelHeadMatchesOneDevice) { exec::check_head(world); }

TEST(ExecutorProcess, MlpBlockBackwardMatchesOneDeviceOnALineAndATwoByTwoMesh) {
  exec::check_mlp_block_backward(world);
}

TEST(ExecutorProcess, OverlappedMlpBlockMatchesOneDeviceInEveryForm) {
  exec::check_mlp_block_overlap(world);
}

TEST(ExecutorProcess, OverlapEdgesMatchOneDevice) { exec::check_overlap_edges(world); }

TEST(ExecutorProcess, HeadBackwardMatchesOneDevice) { exec::check_head_backward(world); }

// Under mpirun with a store (MESHFUSE_STORE_PATH, the dist_mpi_4_processes_executor_on_gloo
// test), the same program runs with its communications on gloo.
TEST(ExecutorProcess, TheCommunicatorBackendIsAParameterOfTheRun) {
  if (world->backend() != CommunicatorBackend::Mpi || !std::getenv("MESHFUSE_STORE_PATH") ||
      !communicator_backend_built(CommunicatorBackend::Gloo))
    GTEST_SKIP() << "needs mpirun, a store and gloo";
  exec::check_backend_parameter(world, CommunicatorBackend::Gloo);
}

TEST(ExecutorProcess, EveryTransitionOfATwoByTwoMeshGivesTheParts) {
  exec::check_every_transition_on_a_2d_mesh(world);
}

TEST(ExecutorProcess, ExecutorsOnOneMeshShareTheCommunicatorsMeshTeams) {
  exec::check_executors_share_mesh_teams(world);
}

TEST(ExecutorProcess, VocabularyParallelFusedLossOverSeveralChunksMatchesOneDevice) {
  exec::check_vocabulary_parallel_fused_loss(world);
}

TEST(ExecutorProcess, ErrorsAreTheSameOnEveryRankAndNothingHangs) {
  if (world->size() != 4) GTEST_SKIP() << "written for 4 ranks";
  exec::check_errors(world);
}

TEST(DistProcess, IsCompletedAnswersAtOnceWhileAnotherThreadWaits) {
  dist::check_is_completed_while_waiting(*world);
}

TEST(DistProcess, ATimedOutRecvIsDroppedAtOnce) { dist::check_dropping_a_timed_out_recv(*world); }

TEST(DistProcess, ARecvOfAnotherSizeFailsAndAbortsNothing) {
  dist::check_recv_of_another_size(*world);
}

TEST(DistProcess, ARankThatComesAfterTheOthersTimedOutLeavesThemRunningCleanly) {
  dist::check_late_rank_after_timeout(*world);
}

TEST(DistProcess, BuffersGivenToAWorkOutliveAWaitThatTimedOut) {
  dist::check_buffers_outlive_a_timed_out_wait(*world);
}

TEST(DistProcess, ADroppedRecvStillTakesItsMessageAndTheTeamGoesOn) {
  dist::check_a_dropped_recv_still_takes_its_message(*world);
}

TEST(DistProcess, ARankThatNeverCallsGivesTheOthersATimeout) { dist::check_timeout(*world); }

}  // namespace
}  // namespace meshfuse::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  meshfuse::CommOptions options;
  options.timeout = std::chrono::seconds(20);  // a failing rank stops the others in seconds
  meshfuse::test::world = meshfuse::init_communicator(options);
  const int status = RUN_ALL_TESTS();
  meshfuse::test::world.reset();
  return status;
}
