// A program that initialised MPI itself below MPI_THREAD_SERIALIZED: the mpi backend refuses it
// with BackendUnavailable naming the level it got and the one it needs, instead of calling MPI
// from several threads where MPI does not allow it. Run by mpirun as one process
// (dist_mpi_thread_level_checked).
#include <gtest/gtest.h>
#include <mpi.h>

#include "meshfuse/distributed/communicator.h"
#include "test_util.h"

namespace meshfuse {
namespace {

int provided = -1;  // what MPI_Init_thread gave main()

TEST(MpiThreadLevel, AProgramThatInitialisedMpiBelowSerializedGetsBackendUnavailable) {
  if (provided >= MPI_THREAD_SERIALIZED)
    GTEST_SKIP() << "MPI_Init_thread gave thread level " << provided << " for SINGLE";
  CommOptions options;
  options.backend = "mpi";
  test::expect_error(
      [&] { init_communicator(options); }, ErrorCode::BackendUnavailable,
      {"mpi", "initialised by the program", "thread level " + std::to_string(provided),
       "MPI_THREAD_SERIALIZED", "MPI_Init_thread"});
}

}  // namespace
}  // namespace meshfuse

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SINGLE, &meshfuse::provided);
  const int status = RUN_ALL_TESTS();
  MPI_Finalize();
  return status;
}
