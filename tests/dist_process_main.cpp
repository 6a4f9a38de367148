// The communicator suite across processes: every rank of a job runs this binary (started by
// `meshfuse launch -n 4` for gloo, `mpirun -np 4` for mpi) on the backend named by
// MESHFUSE_BACKEND, and checks its own results. A rank that fails exits non-zero, and the
// launcher reports it.
#include <gtest/gtest.h>

#include <cstdlib>

#include "dist_cases.h"
#include "executor_cases.h"
#include "meshfuse/distributed/communicator.h"

namespace meshfuse::test {
namespace {

std::shared_ptr<Communicator> world;

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

TEST(DistProcess, ARankThatComesAfterTheOthersTimedOutLeavesThemRunningCleanly) {
  dist::check_late_rank_after_timeout(*world);
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
