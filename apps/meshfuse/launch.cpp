#include "launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "meshfuse/core/error.h"

extern char** environ;

namespace meshfuse::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Signals the launcher reads through a signalfd (blocked, so they queue there instead of acting).
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MESHFUSE_CHECK(fd >= 0, ErrorCode::Internal, "launch: socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  close(fd);
  MESHFUSE_CHECK(ok, ErrorCode::Internal, "launch: no free port on 127.0.0.1: {}",
                 std::strerror(error));
  return ntohs(addr.sin_port);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  const int sig = WTERMSIG(status);
  const char* abbrev = sigabbrev_np(sig);
  return fmt::format("was killed by signal {} (SIG{})", sig, abbrev ? abbrev : "?");
}

int exit_code_of(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// False when fd no longer takes output (a closed pipe: EPIPE, SIGPIPE being ignored). An fd left
// non-blocking by whoever started us (EAGAIN) is waited for, as a blocking one would be.
bool write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, -1);
      continue;
    }
    if (n <= 0) return false;
    text.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Writes text to an fd, false when it takes no more (Launcher::write_output).
using Writer = std::function<bool(int fd, std::string_view text)>;

// One of a rank's output pipes, forwarded to `target` (1 or 2) one whole line at a time; a line
// that grows past kMaxLine unended goes out as it is (prefixed: as a line of its own), so that one
// endless line neither holds the rest back nor fills the launcher's memory.
struct Output {
  static constexpr std::size_t kMaxLine = std::size_t{1} << 20;
  int fd = -1;
  int target = 1;
  std::string prefix;
  std::string pending;  // a line not yet ended

  void forward(std::string_view data, const Writer& write) {
    std::size_t start = 0, end, from = pending.size();  // the new data only is searched
    pending.append(data);
    std::string lines;
    while ((end = pending.find('\n', from)) != std::string::npos) {
      lines.append(prefix).append(pending, start, end + 1 - start);
      start = from = end + 1;
    }
    pending.erase(0, start);
    if (pending.size() > kMaxLine) {  // unprefixed output goes on as it came (JSON)
      lines.append(prefix).append(pending).append(prefix.empty() ? "" : "\n");
      pending.clear();
    }
    // Where our output has gone (| head), the rank's does too: its pipe is closed, so that its
    // next write fails as it would have written to that reader itself (SIGPIPE).
    if (!write(target, lines)) {
      pending.clear();
      close_pipe(write);
    }
  }
  void close_pipe(const Writer& write) {
    if (!pending.empty()) write(target, prefix + pending + "\n");
    pending.clear();
    close(fd);
    fd = -1;
  }
};

struct Rank {
  pid_t pid = -1;
  std::optional<int> status;  // set once reaped
  Output out[2];
};

[[noreturn]] void exec_child(const LaunchOptions& options, const std::vector<std::string>& env,
                             int rank, pid_t launcher, int out_fd, int err_fd,
                             const sigset_t& old_mask) {
  // Own process group: stopping a rank reaches the processes it started too. Dying with the
  // launcher, by SIGKILL (nobody is left to follow a SIGTERM up): a killed launcher leaves no
  // rank behind.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(128 + SIGKILL);
  // stdin: the launcher's for rank 0 where it is a file or a pipe (as mpirun gives it), else
  // /dev/null: a rank is not in the terminal's foreground group, and reading the terminal
  // (input(), pdb) would stop it (SIGTTIN) and the job with it; it reads end of file instead.
  if (rank != 0 || isatty(STDIN_FILENO)) {
    const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
  }
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  signal(SIGPIPE, SIG_DFL);  // ignored by the launcher: not by its ranks
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  std::vector<char*> argv, envp;
  for (const std::string& a : options.command) argv.push_back(const_cast<char*>(a.c_str()));
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  argv.push_back(nullptr);
  envp.push_back(nullptr);
  execvpe(argv[0], argv.data(), envp.data());
  const int error = errno;
  const std::string message = fmt::format("meshfuse launch: cannot run '{}': {}\n",
                                          options.command[0], std::strerror(error));
  write_all(STDERR_FILENO, message);
  _exit(error == ENOENT ? 127 : 126);  // as a shell: not found, or found and not executable
}

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : options_(options) {}

  int run() {
    const int port = options_.master_port ? options_.master_port : free_port();
    secret_ = job_secret();
    launch_id_ = random_id();
    sigset_t mask, old_mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    for (int sig : kForwarded) {
      // SIGHUP ignored (nohup) stays ignored, and is not forwarded: the job outlives the
      // terminal. SIGINT and SIGTERM are heard even where inherited as ignored (a background
      // shell job ignores SIGINT).
      if (sig == SIGHUP && signal(sig, SIG_IGN) == SIG_IGN) continue;
      signal(sig, SIG_DFL);
      sigaddset(&mask, sig);
    }
    // A reader of our output that goes away (| head) makes writes fail, not the launcher die
    // with its ranks left running. SIGCHLD inherited as ignored would have the kernel reap the
    // ranks unseen (and the ranks' own children).
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, SIG_DFL);
    sigprocmask(SIG_BLOCK, &mask, &old_mask);
    signal_fd_ = signalfd(-1, &mask, SFD_CLOEXEC);
    MESHFUSE_CHECK(signal_fd_ >= 0, ErrorCode::Internal, "launch: signalfd: {}",
                   std::strerror(errno));

    ranks_.resize(static_cast<std::size_t>(options_.nprocs));
    std::exception_ptr start_error;  // the launcher's own: raised once the ranks started are gone
    for (int r = 0; r < options_.nprocs; ++r) {
      if (stop_signal_ || first_failure_) break;  // interrupted or failed: start no more
      try {
        start(r, port, old_mask);
      } catch (const std::exception&) {
        start_error = std::current_exception();
        stop(SIGTERM);
        break;
      }
      drain_signals();
    }
    loop();
    // Reaped only now: until every rank's group has been signalled, its pid (the group's id)
    // must not be free for another process to take.
    for (Rank& rank : ranks_)
      if (rank.pid > 0) waitpid(rank.pid, nullptr, 0);
    close(signal_fd_);
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    if (start_error) std::rethrow_exception(start_error);
    const int code = report();
    if (stop_signal_ && !first_failure_) {
      // Interrupted: die of the signal, as the ranks did. A shell that ran the launcher in a loop
      // stops the loop only for a child killed by SIGINT; an exit status of 130 reads as handled.
      std::fflush(nullptr);
      signal(stop_signal_, SIG_DFL);
      raise(stop_signal_);
    }
    return code;  // reached where whoever started the launcher blocked the signal
  }

 private:
  void start(int r, int port, const sigset_t& old_mask) {
    Rank& rank = ranks_[static_cast<std::size_t>(r)];
    int pipes[2][2] = {{-1, -1}, {-1, -1}};
    for (auto& p : pipes)
      if (pipe2(p, O_CLOEXEC) != 0) {
        const int error = errno;
        for (auto& q : pipes)
          for (int fd : q)
            if (fd >= 0) close(fd);
        fail(ErrorCode::Internal, "launch: cannot start rank {}: pipe: {}", r,
             std::strerror(error));
      }
    const std::vector<std::string> env =
        launch_env(r, options_.nprocs, port, options_.backend, secret_, launch_id_);
    const pid_t launcher = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      const int error = errno;
      for (auto& p : pipes) close(p[0]), close(p[1]);
      fail(ErrorCode::Internal, "launch: cannot start rank {}: fork: {}", r, std::strerror(error));
    }
    if (pid == 0) exec_child(options_, env, r, launcher, pipes[0][1], pipes[1][1], old_mask);
    setpgid(pid, pid);  // as the child does: whichever runs first, the group exists before kill()
    rank.pid = pid;
    for (int s = 0; s < 2; ++s) {
      close(pipes[s][1]);
      rank.out[s] = {pipes[s][0], s + 1, options_.prefix ? fmt::format("[rank{}]: ", r) : "", {}};
    }
  }

  // Sends `sig` to every rank's process group; SIGKILL follows after the grace period.
  void stop(int sig) {
    for (const Rank& rank : ranks_)
      if (rank.pid > 0 && !rank.status) kill(-rank.pid, sig);
    if (!kill_at_)
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(options_.grace_s));
  }

  // Also what a finished rank left behind in its group. Safe from pid reuse: the ranks are not
  // reaped before (reap() only looks), so no group id is free for another process yet.
  void kill_groups() {
    for (const Rank& rank : ranks_)
      if (rank.pid > 0) kill(-rank.pid, SIGKILL);
    killed_ = true;
  }

  // Notes the ranks that have ended, leaving them unreaped (WNOWAIT): run() reaps them last.
  void reap() {
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rank = ranks_[r];
      if (rank.pid <= 0 || rank.status) continue;
      siginfo_t info{};
      if (waitid(P_PID, static_cast<id_t>(rank.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          info.si_pid != rank.pid)
        continue;
      const int status = info.si_code == CLD_EXITED ? W_EXITCODE(info.si_status, 0)
                                                    : W_EXITCODE(0, info.si_status);
      rank.status = status;
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (failed && !first_failure_ && !stop_signal_) {
        first_failure_ = static_cast<int>(r);
        stop(SIGTERM);
      }
    }
  }

  // write_all for the ranks' output, which keeps handling signals and the grace period's kill while
  // the reader is slow (a stalled `| less` or log shipper): a blocking write would hold SIGTERM and
  // Ctrl-C until the reader went on. Once interrupted and every rank has ended, output that the
  // reader does not take within a second is dropped, so that the launcher ends too. At most
  // PIPE_BUF bytes a write to a pipe: what poll's POLLOUT promises it takes without blocking.
  bool write_output(int fd, std::string_view text) {
    struct stat st {};
    const std::size_t most = fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode) ? PIPE_BUF : text.size();
    while (!text.empty()) {
      std::array<pollfd, 2> fds{{{fd, POLLOUT, 0}, {signal_fd_, POLLIN, 0}}};
      int timeout_ms = -1;
      if (running() && kill_at_ && !killed_)
        timeout_ms = ms_until(*kill_at_);
      else if (stop_signal_ && !running())
        timeout_ms = 1000;
      const int ready = poll(fds.data(), fds.size(), timeout_ms);
      if (ready < 0 && errno != EINTR)
        fail(ErrorCode::Internal, "launch: poll: {}", std::strerror(errno));
      if (fds[1].revents) drain_signals();
      kill_if_due();
      if (fds[0].revents & (POLLERR | POLLNVAL)) return false;
      if (!(fds[0].revents & (POLLOUT | POLLHUP))) {
        if (stop_signal_ && !running() && ready == 0) return false;
        continue;
      }
      const ssize_t n = write(fd, text.data(), std::min(text.size(), most));
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) return false;
      text.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  // Milliseconds from now to `when` for poll, 0 once it has passed.
  static int ms_until(Clock::time_point when) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(when - Clock::now());
    return static_cast<int>(std::max<std::int64_t>(0, left.count()));
  }

  // SIGKILL to every rank's group at the grace period's end, or once every rank has ended after a
  // failure or an interrupt (what they started, still in their groups, goes too).
  void kill_if_due() {
    if (killed_) return;
    if (running() ? kill_at_ && Clock::now() >= *kill_at_ : first_failure_ || stop_signal_)
      kill_groups();
  }

  void drain_signals() {
    signalfd_siginfo info;
    while (true) {
      pollfd p{signal_fd_, POLLIN, 0};
      if (poll(&p, 1, 0) <= 0) return;
      if (read(signal_fd_, &info, sizeof info) != sizeof info) return;
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) {
        reap();
      } else {
        reap();  // a failure that came with the interrupt is still the failure
        if (!stop_signal_) stop_signal_ = sig;
        stop(sig);  // forwarded as it came (a second Ctrl-C too)
      }
    }
  }

  bool running() const {
    for (const Rank& rank : ranks_)
      if (rank.pid > 0 && !rank.status) return true;
    return false;
  }

  void loop() {
    std::optional<Clock::time_point> drain_until;  // once every rank has exited
    while (true) {
      reap();  // a child may have exited before the signalfd existed to hear of it
      const bool live = running();
      kill_if_due();
      if (!live && !drain_until) drain_until = Clock::now() + std::chrono::seconds(1);

      std::vector<pollfd> fds{{signal_fd_, POLLIN, 0}};
      std::vector<Output*> outputs;
      for (Rank& rank : ranks_)
        for (Output& out : rank.out)
          if (out.fd >= 0) {
            fds.push_back({out.fd, POLLIN, 0});
            outputs.push_back(&out);
          }
      if (!live && outputs.empty()) return;

      std::optional<Clock::time_point> wake = drain_until;
      if (live && kill_at_ && !killed_) wake = kill_at_;
      const int timeout_ms = wake ? ms_until(*wake) : -1;
      const int ready = poll(fds.data(), fds.size(), timeout_ms);
      if (ready < 0 && errno != EINTR)
        fail(ErrorCode::Internal, "launch: poll: {}", std::strerror(errno));

      if (fds[0].revents) drain_signals();
      for (std::size_t i = 0; i < outputs.size(); ++i) {
        if (!fds[i + 1].revents) continue;
        char buffer[65536];
        const ssize_t n = read(outputs[i]->fd, buffer, sizeof buffer);
        if (n > 0)
          outputs[i]->forward({buffer, static_cast<std::size_t>(n)}, writer_);
        else if (n == 0 || errno != EINTR)
          outputs[i]->close_pipe(writer_);
      }
      kill_if_due();
      if (drain_until && Clock::now() >= *drain_until) {
        // Whatever still holds a pipe open outlived its rank; stop listening to it.
        for (Rank& rank : ranks_)
          for (Output& out : rank.out)
            if (out.fd >= 0) out.close_pipe(writer_);
        return;
      }
    }
  }

  int report() const {
    const auto name = [&](int r) {
      const Rank& rank = ranks_[static_cast<std::size_t>(r)];
      return fmt::format("rank {} (pid {}) {}", r, rank.pid, describe(*rank.status));
    };
    // An interrupt during the grace period after a failure: the failure is what is reported.
    if (stop_signal_ && !first_failure_) {
      const char* abbrev = sigabbrev_np(stop_signal_);
      // write_all, not stdio: a stderr whose reader has gone must not make the launcher throw.
      write_all(STDERR_FILENO,
                fmt::format("meshfuse launch: interrupted by SIG{}, forwarded to every rank\n",
                            abbrev ? abbrev : "?"));
      return 128 + stop_signal_;
    }
    if (!first_failure_) return 0;
    std::string others;
    for (int r = 0; r < options_.nprocs; ++r) {
      const Rank& rank = ranks_[static_cast<std::size_t>(r)];
      if (r != *first_failure_ && rank.status && *rank.status != 0)
        others += fmt::format("; then {}", name(r));
    }
    write_all(STDERR_FILENO, fmt::format("meshfuse launch: {}; the other ranks were stopped{}\n",
                                         name(*first_failure_), others));
    return exit_code_of(*ranks_[static_cast<std::size_t>(*first_failure_)].status);
  }

  const LaunchOptions& options_;
  const Writer writer_ = [this](int fd, std::string_view text) { return write_output(fd, text); };
  std::string secret_;     // the store's, the same for every rank
  std::string launch_id_;  // this launch's, told apart from others sharing an exported secret
  std::vector<Rank> ranks_;
  int signal_fd_ = -1;
  int stop_signal_ = 0;               // the first SIGINT/SIGTERM/SIGHUP the launcher got
  std::optional<int> first_failure_;  // the first rank that failed
  std::optional<Clock::time_point> kill_at_;
  bool killed_ = false;
};

}  // namespace

std::string random_id() {
  unsigned char bytes[16];
  MESHFUSE_CHECK(getrandom(bytes, sizeof(bytes), 0) == static_cast<ssize_t>(sizeof(bytes)),
                 ErrorCode::Internal, "launch: getrandom: {}", std::strerror(errno));
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

std::string job_secret() {
  if (const char* given = std::getenv("MESHFUSE_STORE_SECRET"); given && *given) return given;
  return random_id();
}

std::vector<std::string> launch_env(int rank, int world, int master_port,
                                    const std::string& backend, const std::string& secret,
                                    const std::string& launch_id) {
  const std::vector<std::pair<std::string, std::string>> ours = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(world)},
      {"GROUP_RANK", "0"},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(master_port)},
      {"MESHFUSE_STORE_SECRET", secret},
      {"MESHFUSE_LAUNCH_ID", launch_id},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    bool replaced = name == "MESHFUSE_BACKEND" && !backend.empty();
    for (const auto& [ours_name, value] : ours) replaced |= name == ours_name;
    if (!replaced) env.emplace_back(entry);
  }
  for (const auto& [name, value] : ours) env.push_back(name + "=" + value);
  if (!backend.empty()) env.push_back("MESHFUSE_BACKEND=" + backend);
  // The ranks write into pipes, where Python buffers its output in blocks: a rank's lines would
  // come when it exits, and be lost when it is killed.
  if (!std::getenv("PYTHONUNBUFFERED")) env.push_back("PYTHONUNBUFFERED=1");
  // N ranks each running OpenMP on every core oversubscribe the machine N times over, and their
  // spinning threads starve each other: each gets its share of the cores unless the caller chose
  // (torchrun sets 1).
  if (!std::getenv("OMP_NUM_THREADS")) {
    cpu_set_t allowed;  // the cores this process may run on (taskset, a container's cpuset)
    CPU_ZERO(&allowed);
    const int cores = ::sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                          ? CPU_COUNT(&allowed)
                          : static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
    env.push_back("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / world)));
  }
  return env;
}

int run_launch(const LaunchOptions& options) {
  MESHFUSE_CHECK(options.nprocs >= 1 && options.nprocs <= 65536, ErrorCode::InvalidArgument,
                 "launch: -n: expected 1 to 65536 processes, got {}", options.nprocs);
  MESHFUSE_CHECK(!options.command.empty(), ErrorCode::InvalidArgument,
                 "launch: expected a command to run after the options (meshfuse launch -n N -- "
                 "COMMAND ARGS...)");
  MESHFUSE_CHECK(options.master_port >= 0 && options.master_port < 65536,
                 ErrorCode::InvalidArgument, "launch: --master-port: expected 0..65535, got {}",
                 options.master_port);
  MESHFUSE_CHECK(options.grace_s >= 0, ErrorCode::InvalidArgument,
                 "launch: --grace-period: expected seconds >= 0, got {}", options.grace_s);
  // Checked here, not only by each rank once it starts.
  if (!options.backend.empty()) {
    try {
      BackendSpec::parse(options.backend);
    } catch (const Error& e) {
      fail(ErrorCode::InvalidArgument, "launch: --backend: {}", e.message());
    }
  }
  return Launcher(options).run();
}

CommunicatorBackend command_backend(const std::string& name, const LaunchInfo& launch,
                                    std::optional<DeviceType> device,
                                    const std::string& ranks_option, int ranks) {
  std::string chosen = name, source = "--backend";
  const char* env = std::getenv("MESHFUSE_BACKEND");
  if (chosen.empty() && env && *env) {
    chosen = env;
    source = fmt::format("MESHFUSE_BACKEND={} (meshfuse launch --backend sets it)", env);
  } else if (chosen.empty()) {
    chosen = launch.launcher == meshfuse::Launcher::OpenMpi ? "mpi"
             : launch.world_size > 1                        ? "gloo"
                                                            : "local";
  }
  CommunicatorBackend backend{};
  try {
    if (chosen.find(':') == std::string::npos) {
      backend = parse_communicator_backend(chosen);
    } else {
      // A spec, as launch --backend and init_communicator take it: its backend for the device.
      const BackendSpec spec = BackendSpec::parse(chosen);
      if (!device)
        device = spec.backends.count(DeviceType::CUDA) && cuda_device_count() > 0 ? DeviceType::CUDA
                                                                                  : DeviceType::CPU;
      backend = spec.for_device(*device);
    }
  } catch (const Error& e) {
    fail(ErrorCode::InvalidArgument, "{}: {}", source, e.message());
  }
  MESHFUSE_CHECK(communicator_backend_built(backend), ErrorCode::BackendUnavailable,
                 "{}: {} is not in this build", source, to_string(backend));
  if (backend == CommunicatorBackend::Local) {
    MESHFUSE_CHECK(launch.world_size == 1, ErrorCode::InvalidArgument,
                   "{}: local runs its ranks as threads of one process ({}); this process is {} "
                   "(start it without a launcher)",
                   source, ranks_option, launch.str());
    return backend;
  }
  MESHFUSE_CHECK(backend != CommunicatorBackend::Nccl || cuda_device_count() > 0,
                 ErrorCode::BackendUnavailable,
                 "{}: nccl moves CUDA tensors, and this machine has no CUDA device", source);
  // mpi's world is MPI_COMM_WORLD: only mpirun makes one of several processes.
  const bool mpi = backend == CommunicatorBackend::Mpi;
  const std::string launchers = mpi ? "mpirun -n N" : "meshfuse launch -n N, torchrun or mpirun";
  MESHFUSE_CHECK(ranks == 0 || ranks == launch.world_size, ErrorCode::InvalidArgument,
                 "{} {}: this job has {} rank(s) on {} (ranks other than local ones come from the "
                 "launcher: {})",
                 ranks_option, ranks, launch.world_size, to_string(backend), launchers);
  // gloo and nccl without a launcher have no rendezvous store either (unless MESHFUSE_STORE_PATH).
  MESHFUSE_CHECK(launch.launcher != meshfuse::Launcher::None || ranks == 1,
                 ErrorCode::InvalidArgument,
                 "{}: {}'s ranks come from a launcher, and this process was started without one "
                 "(a job of one rank); start them with {}{}",
                 source, to_string(backend), launchers,
                 mpi ? fmt::format(", or pass {} 1 to run one", ranks_option) : std::string());
  return backend;
}

}  // namespace meshfuse::cli
