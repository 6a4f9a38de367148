# The communicator suite across processes: one binary, started 4 times by `meshfuse launch`
# (gloo, rendezvous through the launcher's TCP store, and once through a file store in a fresh
# directory) and by mpirun (mpi).
add_executable(meshfuse_dist_tests ${CMAKE_CURRENT_SOURCE_DIR}/dist_process_main.cpp)
target_link_libraries(meshfuse_dist_tests PRIVATE meshfuse::meshfuse GTest::gtest)
target_include_directories(meshfuse_dist_tests PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_options(meshfuse_dist_tests PRIVATE ${MESHFUSE_WARNINGS})

if(MESHFUSE_WITH_GLOO AND TARGET meshfuse_cli)
  add_test(NAME dist_gloo_4_processes
           COMMAND meshfuse_cli launch -n 4 --backend gloo -- $<TARGET_FILE:meshfuse_dist_tests>)
  add_test(NAME dist_gloo_4_processes_file_store
           COMMAND sh -c "d=$(mktemp -d) && MESHFUSE_STORE_PATH=$d \"$@\"; s=$?; rm -rf \"$d\"; exit $s"
                   sh $<TARGET_FILE:meshfuse_cli> launch -n 4 --backend gloo --
                   $<TARGET_FILE:meshfuse_dist_tests> --gtest_filter=*SubTeams*)
  # The whole suite in each of 4 processes: about 10 s plain, several times that under ASan on 2
  # cores beside another test.
  set_tests_properties(dist_gloo_4_processes dist_gloo_4_processes_file_store PROPERTIES TIMEOUT 300)
  # Rank 2 killed midway (DistFault): the other three raise within their timeout, the launcher
  # names the dead rank. What is checked is the errors and the exits, not leaks at exit of
  # processes whose communicator a dead peer broke.
  foreach(in collective executor)
    add_test(NAME dist_gloo_4_processes_rank_killed_in_${in}
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/expect_rank_killed.sh 3
                     "rank 2 \\(pid [0-9]+\\) was killed by signal 9"
                     $<TARGET_FILE:meshfuse_cli> launch -n 4 --backend gloo --grace-period 8 --
                     $<TARGET_FILE:meshfuse_dist_tests> --gtest_filter=DistFault.*)
    set_tests_properties(dist_gloo_4_processes_rank_killed_in_${in} PROPERTIES TIMEOUT 120
                         ENVIRONMENT
                         "MESHFUSE_TEST_KILL_RANK=2;MESHFUSE_TEST_KILL_IN=${in};ASAN_OPTIONS=detect_leaks=0")
  endforeach()
endif()
if(MESHFUSE_WITH_MPI AND MPIEXEC_EXECUTABLE)
  add_test(NAME dist_mpi_4_processes
           COMMAND ${MPIEXEC_EXECUTABLE} -np 4 --oversubscribe --allow-run-as-root
                   -x MESHFUSE_BACKEND=mpi $<TARGET_FILE:meshfuse_dist_tests>)
  set_tests_properties(dist_mpi_4_processes PROPERTIES TIMEOUT 300)
  # The executor's plan on gloo in an mpi job (Communicator::with_backends), which needs a store.
  if(MESHFUSE_WITH_GLOO)
    add_test(NAME dist_mpi_4_processes_executor_on_gloo
             COMMAND sh -c "d=$(mktemp -d) && MESHFUSE_STORE_PATH=$d \"$@\"; s=$?; rm -rf \"$d\"; exit $s"
                     sh ${MPIEXEC_EXECUTABLE} -np 4 --oversubscribe --allow-run-as-root
                     -x MESHFUSE_BACKEND=mpi -x MESHFUSE_STORE_PATH $<TARGET_FILE:meshfuse_dist_tests>
                     --gtest_filter=ExecutorProcess.TheCommunicatorBackend*)
    set_tests_properties(dist_mpi_4_processes_executor_on_gloo PROPERTIES TIMEOUT 120)
    if(MESHFUSE_SANITIZE)
      set_tests_properties(dist_mpi_4_processes_executor_on_gloo PROPERTIES
                           ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
    endif()
  endif()
  # A program that initialised MPI below MPI_THREAD_SERIALIZED itself.
  add_executable(mpi_thread_level_test ${CMAKE_CURRENT_SOURCE_DIR}/mpi_thread_level_main.cpp)
  target_link_libraries(mpi_thread_level_test PRIVATE meshfuse::meshfuse GTest::gtest MPI::MPI_CXX)
  target_include_directories(mpi_thread_level_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_options(mpi_thread_level_test PRIVATE ${MESHFUSE_WARNINGS})
  add_test(NAME dist_mpi_thread_level_checked
           COMMAND ${MPIEXEC_EXECUTABLE} -np 1 --allow-run-as-root
                   $<TARGET_FILE:mpi_thread_level_test>)
  set_tests_properties(dist_mpi_thread_level_checked PROPERTIES TIMEOUT 60)
  if(MESHFUSE_SANITIZE)
    set_tests_properties(dist_mpi_thread_level_checked PROPERTIES
                         ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
  endif()
  # Rank 2 killed midway under mpirun: Open MPI ends the job (its errors are fatal to the job, and
  # Debian's has no fault-tolerant MPI), so the check is that mpirun names the dead rank and nothing
  # hangs; a survivor may raise first.
  foreach(in collective executor)
    add_test(NAME dist_mpi_4_processes_rank_killed_in_${in}
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/expect_rank_killed.sh 0
                     "rank 2 with PID [0-9]+ on node .* exited on signal 9"
                     ${MPIEXEC_EXECUTABLE} -np 4 --oversubscribe --allow-run-as-root
                     -x MESHFUSE_BACKEND=mpi -x MESHFUSE_TEST_KILL_RANK=2
                     -x MESHFUSE_TEST_KILL_IN=${in} -x ASAN_OPTIONS=detect_leaks=0
                     $<TARGET_FILE:meshfuse_dist_tests> --gtest_filter=DistFault.*)
    set_tests_properties(dist_mpi_4_processes_rank_killed_in_${in} PROPERTIES TIMEOUT 120)
  endforeach()
  # Open MPI leaves ~130 KB per process allocated at exit, mostly from its plugins, which are
  # unloaded by then (LeakSanitizer cannot even name them, so no suppression file can match):
  # the sanitizer build checks the mpi run for memory errors and undefined behaviour, not leaks.
  if(MESHFUSE_SANITIZE)
    set_tests_properties(dist_mpi_4_processes PROPERTIES ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
  endif()
endif()
