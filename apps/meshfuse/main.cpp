// The meshfuse CLI: `info`, `bench`, `run`, `launch` and `comm-bench`.
//
// Exit codes: 0 success; 1 a bench or run check failed; 2 bad arguments, a bad model config, or a
// device / backend this build or machine does not have (the message says which); 3 an unexpected
// internal error. `launch` exits with its first failed rank's status instead (launch.h).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <iostream>
#include <limits>
#include <string_view>

#include "bench.h"
#include "comm_bench.h"
#include "launch.h"
#include "meshfuse/core/error.h"
#include "meshfuse/info.h"
#include "run.h"

// A count option of at least 1, saying what came (CLI::PositiveNumber prints its range as doubles,
// and CLI::Range calls a word or a fraction out of range).
const CLI::Validator kPositive(
    [](const std::string& s) {
      std::int64_t v = 0;
      const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), v);
      if (error != std::errc() || end != s.data() + s.size())
        return fmt::format("expected a whole number from 1 to {}, got '{}'",
                           std::numeric_limits<std::int64_t>::max(), s);
      return v >= 1 ? std::string() : fmt::format("expected >= 1, got {}", v);
    },
    "POSITIVE");
// A list given empty would read as the default (all of them).
const CLI::Validator kNonEmpty(
    [](const std::string& s) { return s.empty() ? std::string("expected a non-empty list") : ""; },
    "LIST");

int main(int argc, char** argv) {
  using meshfuse::cli::BenchOptions;
  CLI::App app{"meshfuse: transformer kernels on any accelerator"};
  app.require_subcommand(1);
  CLI::App* info = app.add_subcommand("info", "version, build options, devices, kernel backends");

  BenchOptions bench_options;
  CLI::App* bench = app.add_subcommand(
      "bench",
      "time every kernel of one transformer layer at a model's shapes, forward and "
      "backward, and check it against the reference backend");
  bench
      ->add_option("--model", bench_options.model,
                   "a shipped model's NAME (configs/models/NAME.json, installed in "
                   "share/meshfuse/models) or the path of a Hugging Face "
                   "config.json")
      ->required();
  bench->add_option("--tokens", bench_options.tokens, "rows (tokens) per call")
      ->capture_default_str();
  bench
      ->add_option("--seq-len", bench_options.seq_len,
                   "steps per sequence of rnn, gru and pack_sequence (default: 4096; rnn and gru "
                   "1024 on the CPU)")
      ->check(kPositive);
  bench->add_option("--dtype", bench_options.dtype, "bf16, f16 or f32")->capture_default_str();
  bench->add_option("--device", bench_options.device, "cpu, or cuda[:N] in CUDA builds")
      ->capture_default_str();
  bench
      ->add_option("--backend", bench_options.backend,
                   "auto (the device's own), reference, cpu or cuda")
      ->capture_default_str();
  bench
      ->add_option("--ops", bench_options.ops,
                   "comma-separated ops to run (default: all; an unknown name lists them)")
      ->check(kNonEmpty);
  bench->add_option("--format", bench_options.format, "table, csv or json")->capture_default_str();
  bench
      ->add_option("--repeats", bench_options.repeats,
                   "timed calls per op and direction (fewer for slow calls)")
      ->capture_default_str();

  meshfuse::cli::RunOptions run_options;
  CLI::App* run = app.add_subcommand(
      "run",
      "run a model's MLP block (tensor + sequence parallel) and head on N ranks, forward and "
      "backward, through the multi-device executor, and check it against one device");
  run->add_option("--model", run_options.model,
                  "a shipped model's NAME (configs/models/NAME.json, installed in "
                  "share/meshfuse/models) or a config.json path")
      ->required();
  run->add_option("--ranks", run_options.ranks,
                  "ranks as threads of this process (local backend; default 4); under a launcher "
                  "its world size")
      ->check(CLI::Range(1, 1 << 16));
  run->add_option("--backend", run_options.backend,
                  "local, gloo, mpi or nccl (default: MESHFUSE_BACKEND, else mpi under mpirun, "
                  "gloo under another launcher, local without one)");
  run->add_option("--tokens", run_options.tokens, "tokens (default: 256 on the CPU, 4096 on CUDA)")
      ->check(kPositive);
  run->add_option("--device", run_options.device,
                  "cpu, or cuda[:N] (nccl under a launcher; local: the ranks as threads on it)")
      ->capture_default_str();
  run->add_option("--dtype", run_options.dtype, "bf16 or f32")->capture_default_str();
  run->add_option("--repeats", run_options.repeats, "timed runs after one warm-up")
      ->capture_default_str();
  run->add_flag("--dump-plan", run_options.dump_plan,
                "print rank 0's plan: every compute step and communication with its backend");
  run->add_option("--format", run_options.format, "table or json")->capture_default_str();
  run->add_option("--overlap", run_options.overlap,
                  "none, collective or ring: communication overlapped with the GEMMs")
      ->capture_default_str();
  run->add_option("--chunks", run_options.chunks,
                  "--overlap collective: row chunks per rank's part (default: the ranks)");
  run->add_option("--streams", run_options.streams,
                  "CUDA: the executor's streams for the chunks")
      ->capture_default_str();

  meshfuse::cli::LaunchOptions launch_options;
  CLI::App* launch = app.add_subcommand(
      "launch",
      "run COMMAND as N local processes with the torchrun environment (RANK, WORLD_SIZE, "
      "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), output prefixed with the rank");
  launch->add_option("-n,--nproc-per-node", launch_options.nprocs, "processes to start")
      ->required();
  launch->add_option("--backend", launch_options.backend,
                     "exported as MESHFUSE_BACKEND (e.g. gloo, nccl, cpu:gloo,cuda:nccl)");
  launch->add_option("--master-port", launch_options.master_port,
                     "MASTER_PORT on 127.0.0.1 (default: a free port)");
  launch
      ->add_option("--grace-period", launch_options.grace_s,
                   "seconds between SIGTERM and SIGKILL when stopping the ranks after a failure")
      ->capture_default_str();
  launch->add_flag("!--no-prefix", launch_options.prefix,
                   "forward output lines as they are, without \"[rankN]: \"");
  launch->add_option("command", launch_options.command,
                     "the program to run and its arguments, after `--`");
  launch->footer("Usage: meshfuse launch -n N [options] -- COMMAND ARGS...");
  // Everything after launch's `--` is the command's, its own options included: split it off here
  // (CLI11 would parse the options in it).
  bool launch_without_dashes = argc > 1 && std::string_view(argv[1]) == "launch";
  if (argc > 2 && std::string_view(argv[1]) == "launch")
    for (int i = 2; i < argc; ++i)
      if (std::string_view(argv[i]) == "--") {
        launch_options.command.assign(argv + i + 1, argv + argc);
        argc = i;
        launch_without_dashes = false;
        break;
      }

  meshfuse::cli::CommBenchOptions comm_options;
  CLI::App* comm_bench = app.add_subcommand(
      "comm-bench",
      "time one collective per message size (doubling) with the nccl-tests algorithm and bus "
      "bandwidths; run it under `meshfuse launch` or mpirun, or with --backend local -n N");
  comm_bench->add_option(
      "--backend", comm_options.backend,
      "local, gloo, mpi or nccl (default: MESHFUSE_BACKEND, else mpi under mpirun, "
      "gloo under another launcher, local without one)");
  comm_bench
      ->add_option("--op", comm_options.op,
                   "all_reduce, all_gather, reduce_scatter, broadcast or all_to_all")
      ->capture_default_str();
  comm_bench->add_option("--min-bytes", comm_options.min_bytes, "smallest message (K, M, G)")
      ->capture_default_str();
  comm_bench->add_option("--max-bytes", comm_options.max_bytes, "largest message (K, M, G)")
      ->capture_default_str();
  comm_bench->add_option("--dtype", comm_options.dtype, "f32 or bf16")->capture_default_str();
  comm_bench->add_option("--iters", comm_options.iters, "timed iterations per size")
      ->capture_default_str();
  comm_bench->add_option("--warmup", comm_options.warmup, "untimed iterations per size")
      ->capture_default_str();
  comm_bench->add_option("--format", comm_options.format, "table, csv or json")
      ->capture_default_str();
  comm_bench
      ->add_option("-n,--nranks", comm_options.nranks,
                   "ranks as threads of this process (--backend local; default 2)")
      ->check(CLI::Range(1, 1 << 16));
  comm_bench->add_flag("--check", comm_options.check,
                       "keep the cross-rank metadata check before each collective (off: the "
                       "transfer alone is timed)");
  comm_bench->add_flag("!--no-copy-bandwidth", comm_options.copy_bandwidth,
                       "skip measuring the device's copy bandwidth (about a second)");

  try {
    app.parse(argc, argv);
    if (*comm_bench) return meshfuse::cli::run_comm_bench(comm_options, std::cout);
    if (*run) return meshfuse::cli::run_model(run_options, std::cout);
    if (*launch) {
      return meshfuse::cli::run_launch(launch_options);
    }
    if (*info) {
      std::cout << meshfuse::info();
      return 0;
    }
    return meshfuse::cli::run_bench(bench_options, std::cout);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message and a pointer to --help
    // The command's own options, given without `--`, are parsed as launch's (a command given:
    // not a mistyped option of launch's own).
    if (launch_without_dashes && !launch_options.command.empty() &&
        dynamic_cast<const CLI::ExtrasError*>(&e))
      fmt::print(stderr,
                 "launch: put the command after `--`: meshfuse launch -n N -- COMMAND "
                 "ARGS...\n");
    return 2;
  } catch (const meshfuse::Error& e) {
    fmt::print(stderr, "meshfuse: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshfuse: internal error: {}\n", e.what());
    return 3;
  }
}
