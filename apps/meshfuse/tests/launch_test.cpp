// `meshfuse launch` run as a user runs it: the ranks' environment, their forwarded output, and
// what happens to every process when one rank fails or the launcher is interrupted.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli_util.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using meshfuse::cli::test::contains;
using meshfuse::cli::test::read_file;

// A scratch directory with the ranks' script and what they write, removed at the end.
class Scratch : public meshfuse::cli::test::ScratchDir {
 public:
  // Writes `body` as a sh script run in this directory; returns its path.
  std::string script(const std::string& body) const {
    const fs::path file = path() / "rank.sh";
    std::ofstream(file) << "cd '" << path().string() << "'\n" << body << "\n";
    return file.string();
  }
  fs::path operator/(const std::string& name) const { return path() / name; }
};

struct LaunchResult {
  int exit_code = -1;
  std::string out, err;
  double seconds = 0;
};

LaunchResult launch(const Scratch& dir, const std::string& options, const std::string& script) {
  const std::string command =
      fmt::format("'{}' launch {} -- sh '{}' >'{}' 2>'{}'", MESHFUSE_CLI_PATH, options,
                  dir.script(script), (dir / "out").string(), (dir / "err").string());
  const auto start = Clock::now();
  const int status = std::system(command.c_str());
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(dir / "out"),
          read_file(dir / "err"), seconds};
}

// Waits (up to 10 s) for a rank to write its pid to `path`; returns it.
pid_t wait_for_pid(const fs::path& path) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    const std::string text = read_file(path);
    if (!text.empty() && text.back() == '\n') return std::stoi(text);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "no pid in " << path;
  return -1;
}

// Whether `pid` still runs 2 s from now at the latest (a zombie waiting for a reaper does not).
// The launcher's kill() only queues the signal: a loaded machine may not have run the target yet
// when the launcher returns (a CI run saw the SIGKILLed `sleep` of a stopped rank still there).
bool still_running(pid_t pid) {
  const auto running = [pid] {
    if (pid <= 0 || kill(pid, 0) != 0) return false;
    const std::string stat = read_file(fmt::format("/proc/{}/stat", pid));
    const std::size_t paren = stat.rfind(')');
    return paren == std::string::npos || stat.substr(paren + 2, 1) != "Z";
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (running()) {
    if (std::chrono::steady_clock::now() > deadline) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

TEST(Launch, EveryRankGetsTheTorchrunEnvironmentAndPrefixedOutput) {
  const Scratch dir;
  const LaunchResult r = launch(dir, "-n 3 --backend gloo --master-port 29517",
                                "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE "
                                "$GROUP_RANK $MASTER_ADDR $MASTER_PORT $MESHFUSE_BACKEND\"\n"
                                "echo oops >&2\nprintf 'no newline'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(
        contains(r.out, fmt::format("[rank{0}]: {0} 3 {0} 3 0 127.0.0.1 29517 gloo\n", rank)))
        << r.out;
    EXPECT_TRUE(contains(r.out, fmt::format("[rank{}]: no newline\n", rank))) << r.out;
    EXPECT_TRUE(contains(r.err, fmt::format("[rank{}]: oops\n", rank))) << r.err;
  }
}

// Each rank gets its share of the cores for OpenMP, unless the caller set OMP_NUM_THREADS.
TEST(Launch, EveryRankGetsItsShareOfTheCoresUnlessOmpNumThreadsIsSet) {
  const Scratch dir;
  const char* callers = std::getenv("OMP_NUM_THREADS");
  const std::string restore = callers ? callers : "";
  ::unsetenv("OMP_NUM_THREADS");
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const int share = std::max(1, CPU_COUNT(&allowed) / 2);
  LaunchResult r = launch(dir, "-n 2 --no-prefix", "echo \"$OMP_NUM_THREADS\"");
  EXPECT_EQ(r.out, fmt::format("{0}\n{0}\n", share)) << r.err;
  ::setenv("OMP_NUM_THREADS", "3", 1);
  r = launch(dir, "-n 2 --no-prefix", "echo \"$OMP_NUM_THREADS\"");
  EXPECT_EQ(r.out, "3\n3\n") << r.err;
  if (callers)
    ::setenv("OMP_NUM_THREADS", restore.c_str(), 1);
  else
    ::unsetenv("OMP_NUM_THREADS");
}

// The port and the store's secret: the same for every rank, a fresh secret per job.
TEST(Launch, DefaultPortAndSecretAreSharedByAllRanksAndNoPrefixLeavesLinesAlone) {
  const Scratch dir;
  const char* callers = std::getenv("MESHFUSE_STORE_SECRET");
  const std::string restore = callers ? callers : "";
  ::unsetenv("MESHFUSE_STORE_SECRET");
  const auto run = [&] {
    const LaunchResult r = launch(dir, "-n 2 --no-prefix",
                                  "echo \"$MASTER_PORT $MESHFUSE_STORE_SECRET $MESHFUSE_BACKEND.\"");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    std::istringstream lines(r.out);
    std::string first, second;
    std::getline(lines, first);
    std::getline(lines, second);
    EXPECT_EQ(first, second);
    return first;
  };
  const std::string first = run();
  EXPECT_GT(std::stoi(first), 0) << first;
  EXPECT_TRUE(first.ends_with(" .")) << "no MESHFUSE_BACKEND without --backend: " << first;
  std::istringstream words(first);
  std::string port, secret;
  words >> port >> secret;
  EXPECT_EQ(secret.size(), 32u) << "128 random bits in hex: " << first;
  EXPECT_EQ(secret.find_first_not_of("0123456789abcdef"), std::string::npos) << secret;
  EXPECT_EQ(run().find(" " + secret + " "), std::string::npos) << "each job its own secret";
  ::setenv("MESHFUSE_STORE_SECRET", "given", 1);
  EXPECT_NE(run().find(" given ."), std::string::npos) << "a secret given to launch is kept";
  if (callers)
    ::setenv("MESHFUSE_STORE_SECRET", restore.c_str(), 1);
  else
    ::unsetenv("MESHFUSE_STORE_SECRET");
}

TEST(Launch, FailingRankFailsTheLaunchNamingItAndStopsTheOthersAndTheirChildren) {
  const Scratch dir;
  // Rank 0 starts a child and sleeps; rank 1 fails once rank 0 and its child are running.
  const LaunchResult r = launch(dir, "-n 2",
                                "if [ $RANK = 0 ]; then\n"
                                "  sleep 100 & echo $! > child\n"
                                "  echo $$ > pid0; wait\n"
                                "else\n"
                                "  while [ ! -s pid0 ]; do sleep 0.01; done; exit 3\n"
                                "fi");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_TRUE(contains(r.err, "meshfuse launch: rank 1 (pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "exited with status 3; the other ranks were stopped")) << r.err;
  EXPECT_LT(r.seconds, 10) << "rank 0 was not stopped";
  EXPECT_FALSE(still_running(wait_for_pid(dir / "pid0")));
  EXPECT_FALSE(still_running(wait_for_pid(dir / "child")));
}

TEST(Launch, RankKilledBySignalIsNamedWithTheSignal) {
  const Scratch dir;
  const LaunchResult r = launch(dir, "-n 2", "if [ $RANK = 1 ]; then kill -KILL $$; fi; sleep 100");
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  EXPECT_TRUE(contains(r.err, "rank 1 (pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "was killed by signal 9 (SIGKILL)")) << r.err;
  EXPECT_LT(r.seconds, 10);
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  const Scratch dir;
  const LaunchResult r =
      launch(dir, "-n 2 --grace-period 0.2",
             "if [ $RANK = 0 ]; then trap '' TERM; echo $$ > pid0; while true; do sleep 0.05; "
             "done; fi\nwhile [ ! -s pid0 ]; do sleep 0.01; done; exit 1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(contains(r.err, "rank 0 (pid ")) << r.err;
  EXPECT_TRUE(contains(r.err, "was killed by signal 9 (SIGKILL)")) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_FALSE(still_running(wait_for_pid(dir / "pid0")));
}

TEST(Launch, SigintIsForwardedToEveryRank) {
  const Scratch dir;
  const std::string script = dir.script("echo $$ > pid$RANK; exec sleep 100");
  const std::string err = (dir / "err").string();
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    freopen(err.c_str(), "w", stderr);
    execl(MESHFUSE_CLI_PATH, "meshfuse", "launch", "-n", "2", "--", "sh", script.c_str(), nullptr);
    _exit(127);
  }
  const pid_t rank0 = wait_for_pid(dir / "pid0"), rank1 = wait_for_pid(dir / "pid1");
  kill(launcher, SIGINT);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  // Killed by it, as the ranks: a shell loop running the launcher stops (an exit 130 did not).
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGINT);
  EXPECT_TRUE(contains(read_file(err), "interrupted by SIGINT, forwarded to every rank"))
      << read_file(err);
  EXPECT_FALSE(still_running(rank0));
  EXPECT_FALSE(still_running(rank1));
}

// A reader that stops reading (a paused `| less`, a stalled log shipper) used to hold the launcher
// in a blocking write with SIGTERM pending: nothing but SIGKILL stopped the job.
TEST(Launch, SigtermStopsTheJobWhileTheReaderOfItsOutputIsStalled) {
  const Scratch dir;
  const std::string script = dir.script(
      "echo $$ > pid$RANK; while true; do echo "
      "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; done");
  const std::string err = (dir / "err").string();
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    freopen(err.c_str(), "w", stderr);
    execl(MESHFUSE_CLI_PATH, "meshfuse", "launch", "-n", "1", "--", "sh", script.c_str(), nullptr);
    _exit(127);
  }
  close(out[1]);  // out[0] is held and never read: the pipe fills
  const pid_t rank = wait_for_pid(dir / "pid0");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  kill(launcher, SIGTERM);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  pid_t done = 0;
  while ((done = waitpid(launcher, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done == 0) {  // still blocked: unblock it for the next tests, then fail
    kill(launcher, SIGKILL);
    waitpid(launcher, &status, 0);
  }
  close(out[0]);
  ASSERT_EQ(done, launcher) << "the launcher did not end within 30 s of SIGTERM";
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_TRUE(contains(read_file(err), "interrupted by SIGTERM")) << read_file(err);
  EXPECT_FALSE(still_running(rank));
}

TEST(Launch, CommandThatCannotRunFailsWith127) {
  const Scratch dir;
  const std::string command = fmt::format("'{}' launch -n 2 -- /nonexistent/program 2>'{}'",
                                          MESHFUSE_CLI_PATH, (dir / "err").string());
  const int status = std::system(command.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 127);
  EXPECT_TRUE(contains(read_file(dir / "err"), "cannot run '/nonexistent/program'"))
      << read_file(dir / "err");
}

// Rank 0 reads the launcher's stdin (a pipe here, as mpirun's rank 0 would), the others
// /dev/null: end of file at once. Every rank had the launcher's: from a terminal a read stopped
// the rank (SIGTTIN: ranks are not in the foreground group) and the job waited for ever; from a
// pipe every rank waited for the writer.
TEST(Launch, RankZeroReadsAPipedStdinAndTheOthersEndOfFile) {
  const Scratch dir;
  int feed[2];  // the launcher's stdin: a pipe this test holds open after one line
  ASSERT_EQ(pipe(feed), 0);
  ASSERT_EQ(write(feed[1], "hello\n", 6), 6);
  const std::string out = (dir / "out").string();
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    dup2(feed[0], STDIN_FILENO);
    close(feed[1]);
    freopen(out.c_str(), "w", stdout);
    execl(MESHFUSE_CLI_PATH, "meshfuse", "launch", "-n", "2", "--", "sh", "-c",
          "read line; echo read $? $line", nullptr);
    _exit(127);
  }
  close(feed[0]);
  int status = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(15);
  while (waitpid(launcher, &status, WNOHANG) == 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  close(feed[1]);  // lets a launcher that waited for it end
  const bool ended = Clock::now() < deadline;
  if (!ended) waitpid(launcher, &status, 0);
  EXPECT_TRUE(ended) << "a rank waited on the launcher's stdin";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(contains(read_file(out), "[rank0]: read 0 hello")) << read_file(out);
  EXPECT_TRUE(contains(read_file(out), "[rank1]: read 1")) << read_file(out);
}

// The report on a stderr whose reader has gone: fmt::print threw there (SIGPIPE ignored), and the
// launcher aborted (134) instead of exiting with the rank's status.
TEST(Launch, AReportToAClosedStderrStillExitsWithTheRanksStatus) {
  const Scratch dir;
  const std::string command = fmt::format(
      "bash -c \"'{}' launch -n 2 -- sh -c 'exec yes' 2>&1 | head -1 >/dev/null; exit "
      "\\${{PIPESTATUS[0]}}\"",
      MESHFUSE_CLI_PATH);
  EXPECT_EQ(WEXITSTATUS(std::system(command.c_str())), 128 + SIGPIPE);
}

// SIGCHLD inherited as ignored: the kernel reaped the ranks unseen and the launcher waited for
// ever.
TEST(Launch, SigchldInheritedAsIgnoredStillEndsTheJob) {
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    signal(SIGCHLD, SIG_IGN);
    execl(MESHFUSE_CLI_PATH, "meshfuse", "launch", "-n", "2", "--", "true", nullptr);
    _exit(127);
  }
  int status = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(15);
  while (waitpid(launcher, &status, WNOHANG) == 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const bool ended = Clock::now() < deadline;
  if (!ended) {
    kill(launcher, SIGKILL);
    waitpid(launcher, &status, 0);
  }
  EXPECT_TRUE(ended);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// --no-prefix output goes on as it came, also a line past the 1 MiB an unended line is held to.
TEST(Launch, UnprefixedLongLinesAreNotSplit) {
  const Scratch dir;
  const LaunchResult r = launch(dir, "-n 1 --no-prefix",
                                "yes x | head -c 6000000 | tr -d '[:space:]'; echo; echo end");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_TRUE(r.out == std::string(3000000, 'x') + "\nend\n")
      << r.out.size() << " bytes, " << std::count(r.out.begin(), r.out.end(), '\n') << " lines";
}

// A reader of the launcher's output that goes away (| head -1): the launcher died of SIGPIPE and
// left its ranks running; now the ranks' own writes meet the closed pipe, and the job ends. Each
// rank writes only once both have their traps: the launcher's SIGTERM after the first rank's
// end would otherwise kill a rank not yet at its trap, which never wrote its pid.
TEST(Launch, AReaderThatGoesAwayEndsTheJobAndLeavesNoRank) {
  const Scratch dir;
  const std::string command = fmt::format(
      "'{}' launch -n 2 -- sh '{}' 2>'{}' | head -1 >/dev/null", MESHFUSE_CLI_PATH,
      dir.script("trap '' TERM; echo $$ > pid$RANK; while [ ! -s pid0 ] || [ ! -s pid1 ]; do "
                 "sleep 0.01; done; while true; do echo line; done"),
      (dir / "err").string());
  const auto start = Clock::now();
  std::system(command.c_str());
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 15);
  EXPECT_FALSE(still_running(wait_for_pid(dir / "pid0")));
  EXPECT_FALSE(still_running(wait_for_pid(dir / "pid1")));
}

// A rank that fails, then Ctrl-C during the grace period: the failure is what is reported.
TEST(Launch, AnInterruptAfterAFailureStillNamesTheFailedRank) {
  const Scratch dir;
  // Rank 1 fails once rank 0 has its trap; rank 0 notes the launcher's SIGTERM, the sign that
  // the launcher has seen the failure and is in the grace period (a fixed sleep was too short on
  // a loaded CI machine), and outlives it.
  const std::string script = dir.script(
      "if [ $RANK = 1 ]; then while [ ! -s pid0 ]; do sleep 0.01; done; echo $$ > pid1; exit 4; "
      "fi; trap 'echo $$ > termed0' TERM; echo $$ > pid0; while true; do sleep 0.05; done");
  const std::string err = (dir / "err").string();
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    freopen(err.c_str(), "w", stderr);
    execl(MESHFUSE_CLI_PATH, "meshfuse", "launch", "-n", "2", "--grace-period", "3", "--", "sh",
          script.c_str(), nullptr);
    _exit(127);
  }
  wait_for_pid(dir / "pid1");
  wait_for_pid(dir / "termed0");
  kill(launcher, SIGINT);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  EXPECT_EQ(WEXITSTATUS(status), 4) << read_file(err);
  EXPECT_TRUE(contains(read_file(err), "rank 1 (pid ")) << read_file(err);
  EXPECT_TRUE(contains(read_file(err), "exited with status 4")) << read_file(err);
}

TEST(Launch, AFileThatIsNotExecutableFailsWith126) {
  const Scratch dir;
  std::ofstream(dir / "data.txt") << "not a program\n";
  const std::string command = fmt::format("'{}' launch -n 1 -- '{}' 2>'{}'", MESHFUSE_CLI_PATH,
                                          (dir / "data.txt").string(), (dir / "err").string());
  EXPECT_EQ(WEXITSTATUS(std::system(command.c_str())), 126);
  EXPECT_TRUE(contains(read_file(dir / "err"), "Permission denied")) << read_file(dir / "err");
}

// Out of descriptors while starting the ranks: those started were left running.
TEST(Launch, AFailureToStartARankStopsTheOnesStartedBefore) {
  const Scratch dir;
  const std::string command = fmt::format(
      // Room for the first ranks' pipes whatever this process has open, none for 64 ranks'.
      "ulimit -n 64; '{}' launch -n 64 --grace-period 0.2 -- sh '{}' 2>'{}'", MESHFUSE_CLI_PATH,
      dir.script("trap '' TERM; echo $$ > pid$RANK; exec sleep 60"), (dir / "err").string());
  const auto start = Clock::now();
  const int status = std::system(command.c_str());
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 15);
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_TRUE(contains(read_file(dir / "err"), "cannot start rank")) << read_file(dir / "err");
  // Every rank that got to its trap (on a loaded machine some die of the SIGTERM before it).
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    const std::string text = read_file(entry.path());
    if (entry.path().filename().string().starts_with("pid") && text.ends_with('\n')) {
      EXPECT_FALSE(still_running(std::stoi(text))) << entry.path();
    }
  }
}

TEST(Launch, BadOptionsAreUsageErrors) {
  const Scratch dir;
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"-n 0 -- true", "-n: expected 1 to 65536 processes, got 0"},
           {"-n 2147483647 -- true", "-n: expected 1 to 65536 processes, got 2147483647"},
           {"-n 2", "expected a command to run after the options"},
           {"-n 2 --master-port 70000 -- true", "--master-port: expected 0..65535, got 70000"},
           {"-- true", "-n"},
           {"-n 2 --backend foo -- true",
            "launch: --backend: communicator backend: unknown name "
            "'foo'"}}) {
    const std::string command =
        fmt::format("'{}' launch {} 2>'{}'", MESHFUSE_CLI_PATH, args, (dir / "err").string());
    const int status = std::system(command.c_str());
    EXPECT_EQ(WEXITSTATUS(status), 2) << args;
    EXPECT_TRUE(contains(read_file(dir / "err"), message))
        << args << ": " << read_file(dir / "err");
  }
}

}  // namespace
