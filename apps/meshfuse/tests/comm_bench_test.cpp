// `meshfuse comm-bench` run as a user runs it (local ranks as threads, gloo ranks under `meshfuse
// launch`), and its size parser.
#include "comm_bench.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_util.h"
#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"

namespace {

using meshfuse::cli::test::CliResult;
using meshfuse::cli::test::contains;
using meshfuse::cli::test::run_cli;

constexpr const char* kQuick = "--iters 3 --warmup 1 --no-copy-bandwidth";

// The checks every record passes: its keys, the quantiles' order and the nccl-tests definitions.
void expect_consistent(const nlohmann::json& record, double bus_factor) {
  const double median = record["median_us"], algbw = record["algbw_gbps"];
  EXPECT_GT(median, 0);
  EXPECT_LE(record["p20_us"].get<double>(), median);
  EXPECT_GE(record["p80_us"].get<double>(), median);
  EXPECT_NEAR(algbw, record["bytes"].get<double>() / (median * 1e3), 1e-9 * algbw);
  EXPECT_NEAR(record["busbw_gbps"].get<double>(), algbw * bus_factor, 1e-9 * algbw);
}

TEST(CommBench, LocalAllReduceGivesOneRecordPerDoublingSizeWithTheBusBandwidth) {
  const CliResult r = run_cli(fmt::format(
      "comm-bench --backend local -n 4 --min-bytes 1K --max-bytes 8K --format json {}", kQuick));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json records = nlohmann::json::parse(r.out);
  ASSERT_EQ(records.size(), 4u) << r.out;
  for (std::size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i]["bytes"], 1024 << i);
    EXPECT_EQ(records[i]["count"], 256 << i);
    EXPECT_EQ(records[i]["op"], "all_reduce");
    EXPECT_EQ(records[i]["backend"], "local");
    EXPECT_EQ(records[i]["device"], "cpu");
    EXPECT_EQ(records[i]["ranks"], 4);
    EXPECT_TRUE(records[i]["copy_gbps"].is_null());
    expect_consistent(records[i], 2.0 * 3 / 4);
  }
}

TEST(CommBench, EveryOpUsesItsNcclTestsBusFactorAndSize) {
  for (const auto& [op, factor] :
       std::vector<std::pair<std::string, double>>{{"all_gather", 0.75},
                                                   {"reduce_scatter", 0.75},
                                                   {"all_to_all", 0.75},
                                                   {"broadcast", 1}}) {
    const CliResult r = run_cli(fmt::format(
        "comm-bench --backend local -n 4 --op {} --dtype bf16 --min-bytes 4K --max-bytes 4K "
        "--format json {}",
        op, kQuick));
    ASSERT_EQ(r.exit_code, 0) << op << ": " << r.err;
    const nlohmann::json records = nlohmann::json::parse(r.out);
    ASSERT_EQ(records.size(), 1u) << r.out;
    EXPECT_EQ(records[0]["op"], op);
    EXPECT_EQ(records[0]["dtype"], "bf16");
    EXPECT_EQ(records[0]["bytes"], 4096) << op << ": the larger buffer";
    EXPECT_EQ(records[0]["count"], 2048) << op;
    expect_consistent(records[0], factor);
  }
}

TEST(CommBench, SizesAreRoundedDownToAMultipleOfTheRanks) {
  const CliResult r = run_cli(fmt::format(
      "comm-bench --backend local -n 3 --min-bytes 1000 --max-bytes 1000 --format csv {}", kQuick));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string header, row;
  std::getline(lines, header);
  std::getline(lines, row);
  EXPECT_EQ(header,
            "op,backend,device,dtype,ranks,bytes,count,median_us,p20_us,p80_us,algbw_gbps,"
            "busbw_gbps,copy_gbps");
  EXPECT_TRUE(row.starts_with("all_reduce,local,cpu,f32,3,996,249,")) << row;
}

TEST(CommBench, TableStatesTheDefinitionsAndTheCopyBandwidth) {
  const CliResult r =
      run_cli("comm-bench --backend local --op all_gather --max-bytes 1K --iters 3 --warmup 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "all_gather f32, 2 ranks on local (cpu)")) << r.out;
  EXPECT_TRUE(contains(r.out, "busbw = algbw * (n-1)/n (nccl-tests)")) << r.out;
  EXPECT_TRUE(contains(r.out, "copy bandwidth (cpu, STREAM-style")) << r.out;
  EXPECT_TRUE(contains(r.out, "        1024         256    local")) << r.out;
}

TEST(CommBench, GlooRanksUnderTheLauncherPrintOnceFromRankZero) {
  if (!meshfuse::communicator_backend_built(meshfuse::CommunicatorBackend::Gloo))
    GTEST_SKIP() << "this build has no gloo";
  const CliResult r = run_cli(fmt::format(
      "launch -n 2 --no-prefix -- '{}' comm-bench --backend gloo --max-bytes 2K --format json {}",
      MESHFUSE_CLI_PATH, kQuick));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json records = nlohmann::json::parse(r.out);
  ASSERT_EQ(records.size(), 2u) << r.out;
  for (const auto& record : records) {
    EXPECT_EQ(record["backend"], "gloo");
    EXPECT_EQ(record["ranks"], 2);
    expect_consistent(record, 1.0);
  }
}

TEST(CommBench, BadOptionsAreUsageErrors) {
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--op all_sum",
            "--op: expected all_reduce, all_gather, reduce_scatter, broadcast or "
            "all_to_all, got 'all_sum'"},
           {"--dtype f16", "--dtype: expected f32 or bf16, got 'f16'"},
           {"--min-bytes 2M --max-bytes 1M", "--min-bytes (2M) is larger than --max-bytes (1M)"},
           {"--max-bytes lots", "--max-bytes: expected a number of bytes"},
           {"--backend tcp", "--backend"},
           {"--format xml", "--format: expected table, csv or json, got 'xml'"},
           {"--iters 0", "--iters: expected >= 1, got 0"},
           {"--warmup -1", "--warmup: expected >= 0, got -1"},
           {"-n 0", "--nranks"},  // not the default 2
           {"-n 3 --min-bytes 1 --max-bytes 4",
            "no size tried (--min-bytes 1 doubled up to --max-bytes 4: 1, 2, 4 bytes) holds an "
            "element of f32 per rank (3 ranks need at least 12 bytes)"},
           // 12 bytes would do, but the doubling from 4 never reaches it.
           {"-n 3 --min-bytes 4 --max-bytes 12",
            "(--min-bytes 4 doubled up to --max-bytes 12: 4, 8 bytes)"}}) {
    const CliResult r = run_cli("comm-bench --backend local " + args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_TRUE(contains(r.err, message)) << args << ": " << r.err;
  }
}

TEST(CommBench, LocalBackendUnderALauncherIsRejected) {
  const CliResult r = run_cli(
      fmt::format("launch -n 2 -- '{}' comm-bench --backend local {}", MESHFUSE_CLI_PATH, kQuick));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "--backend: local runs its ranks as threads of one process"))
      << r.err;
}

// A launched backend started without a launcher is a job of one rank: refused (it once ran one
// rank where the local default runs two), naming the launchers that start its ranks; mpi's come
// from mpirun alone, and -n 1 asks for its one rank (gloo's has no rendezvous store either).
TEST(CommBench, ALaunchedBackendWithoutALauncherIsRefusedNamingItsLaunchers) {
  for (const auto backend :
       {meshfuse::CommunicatorBackend::Gloo, meshfuse::CommunicatorBackend::Mpi}) {
    if (!meshfuse::communicator_backend_built(backend)) continue;
    const std::string name(meshfuse::to_string(backend));
    const bool mpi = name == "mpi";
    const std::string launchers =
        mpi ? "mpirun -n N, or pass -n 1 to run one" : "meshfuse launch -n N, torchrun or mpirun";
    const CliResult r = run_cli(fmt::format("comm-bench --backend {} {}", name, kQuick));
    EXPECT_EQ(r.exit_code, 2) << name;
    EXPECT_TRUE(contains(r.err, fmt::format("--backend: {}'s ranks come from a launcher, and this "
                                            "process was started without one (a job of one rank); "
                                            "start them with {}",
                                            name, launchers)))
        << r.err;
    if (!mpi) {
      EXPECT_FALSE(contains(r.err, "-n 1")) << r.err;
    }
    // From MESHFUSE_BACKEND, the message says so.
    const CliResult env = run_cli(fmt::format("comm-bench {}", kQuick), "MESHFUSE_BACKEND=" + name);
    EXPECT_EQ(env.exit_code, 2) << name;
    EXPECT_TRUE(contains(env.err, fmt::format("MESHFUSE_BACKEND={} (meshfuse launch --backend sets "
                                              "it): {}'s ranks come from a launcher",
                                              name, name)))
        << env.err;
    const CliResult two = run_cli(fmt::format("comm-bench --backend {} -n 2 {}", name, kQuick));
    EXPECT_EQ(two.exit_code, 2) << name;
    EXPECT_TRUE(contains(two.err, fmt::format("-n 2: this job has 1 rank(s) on {} (ranks other "
                                              "than local ones come from the launcher: {}",
                                              name, mpi ? "mpirun -n N)" : launchers + ")")))
        << two.err;
  }
  if (meshfuse::communicator_backend_built(meshfuse::CommunicatorBackend::Mpi)) {
    // A singleton MPI process: Open MPI's own allocations outlive MPI_Finalize, which
    // LeakSanitizer would report as the command's failure (as for tests/dist.cmake's singletons).
    const CliResult one = run_cli(
        fmt::format("comm-bench --backend mpi -n 1 --max-bytes 2K --format json {}", kQuick),
        "ASAN_OPTIONS=detect_leaks=0");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    EXPECT_EQ(nlohmann::json::parse(one.out)[0]["ranks"], 1) << one.out;
  }
}

TEST(CommBench, NcclWithoutACudaDeviceIsRefusedNamingTheOption) {
  if (!meshfuse::communicator_backend_built(meshfuse::CommunicatorBackend::Nccl) ||
      meshfuse::cuda_device_count() > 0)
    GTEST_SKIP() << "needs a build with nccl on a machine without a CUDA device";
  const CliResult r = run_cli(fmt::format("comm-bench --backend nccl {}", kQuick));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.err,
                       "--backend: nccl moves CUDA tensors, and this machine has no CUDA "
                       "device"))
      << r.err;
}

TEST(CommBench, ByteSizesTakeBinarySuffixes) {
  using meshfuse::cli::parse_bytes;
  EXPECT_EQ(parse_bytes("4096", "x"), 4096);
  EXPECT_EQ(parse_bytes("1K", "x"), 1024);
  EXPECT_EQ(parse_bytes("1kib", "x"), 1024);
  EXPECT_EQ(parse_bytes("64M", "x"), 64 << 20);
  EXPECT_EQ(parse_bytes("1GB", "x"), 1 << 30);
  EXPECT_EQ(parse_bytes("8G", "x"), std::int64_t{8} << 30);
  for (const char* bad : {"", "K", "1T", "-1K", "0", "1.5M"})
    EXPECT_THROW(parse_bytes(bad, "--max-bytes"), meshfuse::Error) << bad;
}

}  // namespace
