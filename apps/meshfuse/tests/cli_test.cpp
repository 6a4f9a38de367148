// The `meshfuse` binary run as a user runs it: output formats, exit codes, error messages.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_util.h"
#include "meshfuse/core/platform.h"
#include "meshfuse/distributed/communicator.h"
#include "report.h"

namespace {

using meshfuse::cli::test::CliResult;
using meshfuse::cli::test::contains;
using meshfuse::cli::test::read_file;
using meshfuse::cli::test::run_cli;
using meshfuse::cli::test::ScratchDir;
namespace fs = std::filesystem;

constexpr const char* kSmallSwiglu = "bench --model llama-3.2-1b --tokens 8 --ops swiglu";

TEST(Cli, InfoListsVersionDevicesAndSwigluForReferenceAndCpu) {
  const CliResult r = run_cli("info");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "meshfuse 0.")) << r.out;
  EXPECT_TRUE(contains(r.out, "blas=")) << r.out;
  EXPECT_TRUE(contains(r.out, "cpu      reference, cpu")) << r.out;
  EXPECT_TRUE(contains(r.out, "communicator backends: local")) << r.out;
#ifdef MESHFUSE_WITH_CUDA
  EXPECT_TRUE(contains(r.out, "cuda gemm library: cuBLASLt ")) << r.out;  // no GPU needed
#endif
  std::istringstream lines(r.out);
  std::string line;
  bool swiglu_row = false;
  while (std::getline(lines, line))
    if (line.starts_with("  swiglu ")) {
      swiglu_row = true;
      // reference, cpu (and cuda in CUDA builds) columns each list the float dtypes.
#ifdef MESHFUSE_WITH_CUDA
      EXPECT_EQ(std::count(line.begin(), line.end(), 'b'), 3) << line;  // "bf16" thrice
#else
      EXPECT_EQ(std::count(line.begin(), line.end(), 'b'), 2) << line;  // "bf16" twice
#endif
    }
  EXPECT_TRUE(swiglu_row) << r.out;
}

// A cuBLASLt that cannot be loaded is reported by info (which still succeeds) with the file.
TEST(Cli, InfoNamesACublasLtItCannotLoad) {
#ifndef MESHFUSE_WITH_CUDA
  GTEST_SKIP() << "a build without CUDA opens no cuBLASLt";
#endif
  const CliResult r = run_cli("info", "MESHFUSE_CUBLASLT_LIBRARY=/nonexistent/libcublasLt.so.13");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "cuda gemm library: unusable: ")) << r.out;
  EXPECT_TRUE(contains(r.out, "cuBLASLt: cannot load /nonexistent/libcublasLt.so.13")) << r.out;
  EXPECT_TRUE(contains(r.out, "MESHFUSE_CUBLASLT_LIBRARY")) << r.out;
}
// The cpu GEMMs' library: the one pinned, or the MKL file named, which info reports unusable.
TEST(Cli, InfoNamesTheCpuGemmLibrary) {
  CliResult r = run_cli("info", "MESHFUSE_CPU_BLAS=onednn");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "cpu gemm library: oneDNN ")) << r.out;
#if defined(__x86_64__)
  // MESHFUSE_CPU_BLAS emptied: a pin in the test's own environment (CI's sanitizer run) would win.
  r = run_cli("info", "MESHFUSE_CPU_BLAS= MESHFUSE_MKL_LIBRARY=/nonexistent/libmkl_rt.so.3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out,
                       "cpu gemm library: unusable: [backend unavailable] gemm: Intel MKL: "
                       "cannot load /nonexistent/libmkl_rt.so.3, the file "
                       "MESHFUSE_MKL_LIBRARY names"))
      << r.out;
#endif
}
TEST(Cli, BenchJsonGivesOneRecordPerDirectionWithEveryKeyAndPasses) {
  const CliResult r = run_cli(std::string(kSmallSwiglu) + " --format json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json records = nlohmann::json::parse(r.out);
  ASSERT_TRUE(records.is_array());
  ASSERT_EQ(records.size(), 2u);
  for (const auto& key : meshfuse::cli::record_columns())
    for (const auto& record : records) EXPECT_TRUE(record.contains(key)) << key;
  EXPECT_EQ(records[0]["op"], "swiglu");
  EXPECT_EQ(records[0]["direction"], "forward");
  EXPECT_EQ(records[1]["direction"], "backward");
  for (const auto& record : records) {
    EXPECT_EQ(record["status"], "pass");
    EXPECT_EQ(record["backend"], "cpu");
    EXPECT_EQ(record["device"], "cpu");
    EXPECT_EQ(record["dtype"], "bf16");
    EXPECT_EQ(record["shape"], "gate, up: [8, 8192]");
    EXPECT_GT(record["median_ms"].get<double>(), 0);
    EXPECT_LE(record["p20_ms"].get<double>(), record["median_ms"].get<double>());
    EXPECT_GE(record["p80_ms"].get<double>(), record["median_ms"].get<double>());
    EXPECT_GT(record["gbps"].get<double>(), 0);
    EXPECT_TRUE(record["tflops"].is_null());  // memory-bound: rated in GB/s
    EXPECT_GT(record["fraction_of_peak"].get<double>(), 0);
    EXPECT_GE(record["max_abs_err"].get<double>(), 0);
  }
  EXPECT_TRUE(contains(r.err, "swiglu backward")) << "progress goes to stderr: " << r.err;
}

TEST(Cli, BenchCsvHasTheJsonColumnsAndATableStatesTheByteFormula) {
  const CliResult csv = run_cli(std::string(kSmallSwiglu) + " --format csv --dtype f32");
  ASSERT_EQ(csv.exit_code, 0) << csv.err;
  std::istringstream lines(csv.out);
  std::string header, forward, backward, extra;
  std::getline(lines, header);
  std::getline(lines, forward);
  std::getline(lines, backward);
  EXPECT_FALSE(std::getline(lines, extra));
  EXPECT_TRUE(
      header.starts_with("op,direction,backend,device,dtype,shape,median_ms,p20_ms,p80_ms,"
                         "gbps,tflops,fraction_of_peak,max_abs_err,max_rel_err,status"))
      << header;
  EXPECT_TRUE(forward.starts_with("swiglu,forward,cpu,cpu,f32,")) << forward;
  EXPECT_TRUE(contains(backward, ",pass,")) << backward;

  const CliResult table = run_cli(std::string(kSmallSwiglu) + " --backend reference --repeats 3");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_TRUE(contains(table.out, "swiglu forward: bytes = 3·N·I·e")) << table.out;
  EXPECT_TRUE(contains(table.out, "copy bandwidth")) << table.out;
  EXPECT_TRUE(contains(table.out, "a cache figure")) << "8 rows fit in the cache: " << table.out;
  EXPECT_TRUE(contains(table.out, "  reference  ")) << table.out;
}

TEST(Cli, BenchLinearIsRatedInTflopsAgainstTheVendorGemm) {
  const CliResult r =
      run_cli("bench --model llama-3.2-1b --tokens 4 --ops linear_k --format json --repeats 3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json records = nlohmann::json::parse(r.out);
  ASSERT_EQ(records.size(), 2u);
  for (const auto& record : records) {
    EXPECT_EQ(record["op"], "linear_k");
    EXPECT_EQ(record["shape"], "x: [4, 2048], weight: [512, 2048]");
    EXPECT_TRUE(record["gbps"].is_null());
    EXPECT_GT(record["tflops"].get<double>(), 0);
    EXPECT_GT(record["fraction_of_peak"].get<double>(), 0);
    EXPECT_EQ(record["status"], "pass");
  }
}

TEST(Cli, OpsGroupSelectsEveryLinearOfTheLayer) {
  // An unknown name lists the valid ones, groups included; nothing runs.
  const CliResult r = run_cli("bench --model llama-3.2-1b --ops nope");
  EXPECT_EQ(r.exit_code, 2);
  for (const char* name : {"linear_q", "linear_k", "linear_v", "linear_o", "linear_gate",
                           "linear_up", "linear_down", "groups: linear", "rmsnorm",
                           "fused_residual_add_rmsnorm", "swiglu", "softmax", "cross_entropy"})
    EXPECT_TRUE(contains(r.err, name)) << name << " in " << r.err;
}

// Runs a bench that must fail before measuring, with exit code 2 and `message` on stderr.
void expect_usage_error(const std::string& args, const std::string& message) {
  const CliResult r = run_cli(args);
  EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
  EXPECT_TRUE(contains(r.err, message)) << args << "\nstderr: " << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(Cli, LaunchWithTheCommandsOptionsBeforeDashesSaysWhereTheCommandGoes) {
  expect_usage_error("launch -n 2 sh -c true",
                     "launch: put the command after `--`: meshfuse launch -n N -- COMMAND ARGS...");
  for (const char* other : {"bench --no-such-option", "launch --nprocs 2"}) {
    const CliResult r = run_cli(other);
    EXPECT_EQ(r.exit_code, 2) << other;
    EXPECT_FALSE(contains(r.err, "put the command after")) << other << ": " << r.err;
  }
}

TEST(Cli, ZeroOrNegativeTokensAndSequenceLengthsAreRejected) {
  expect_usage_error("bench --model llama-3.2-1b --seq-len 0", "--seq-len");  // not the default
  expect_usage_error("bench --model llama-3.2-1b --tokens 0",
                     "--tokens: expected a positive number of tokens, got 0");
  expect_usage_error("bench --model llama-3.2-1b --tokens -5",
                     "--tokens: expected a positive number of tokens, got -5");
  expect_usage_error("bench --model llama-3.2-1b --tokens many", "--tokens");
  expect_usage_error("bench --model llama-3.2-1b --ops ''", "--ops: expected a non-empty list");
}

TEST(Cli, UnknownOpIsRejectedListingTheKnownOnes) {
  expect_usage_error("bench --model llama-3.2-1b --ops swiglu,gelu",
                     "--ops: unknown op 'gelu'; expected a comma-separated list of: ");
  expect_usage_error("bench --model llama-3.2-1b --ops swiglu,gelu", "swiglu");
}

TEST(Cli, UnknownDtypeIsRejected) {
  expect_usage_error("bench --model llama-3.2-1b --dtype f64",
                     "--dtype: expected bf16, f16 or f32, got 'f64'");
  expect_usage_error("bench --model llama-3.2-1b --dtype int4",
                     "--dtype: expected bf16, f16 or f32, got 'int4'");
}

TEST(Cli, UnknownFormatIsRejected) {
  expect_usage_error("bench --model llama-3.2-1b --format xml",
                     "--format: expected table, csv or json, got 'xml'");
}

TEST(Cli, MissingModelIsRejectedListingTheShippedOnes) {
  expect_usage_error("bench --model llama-9", "no model named 'llama-9'");
  expect_usage_error("bench --model llama-9", "llama-3.2-1b");
  expect_usage_error("bench --model /nonexistent/config.json",
                     "cannot read the config file '/nonexistent/config.json'");
  expect_usage_error("bench --tokens 8", "--model is required");
}

TEST(Cli, MalformedOrIncompleteConfigIsRejected) {
  const ScratchDir dir;
  const fs::path broken = dir.path() / "broken.json", partial = dir.path() / "partial.json";
  std::ofstream(broken) << "{\"hidden_size\": 2048,";
  std::ofstream(partial)
      << R"({"intermediate_size": 64, "num_attention_heads": 2, "vocab_size": 8})";
  expect_usage_error("bench --model " + broken.string(), "not valid JSON");
  expect_usage_error("bench --model " + partial.string(),
                     "missing key 'hidden_size' (expected a positive integer)");
}

TEST(Cli, CudaBackendWithoutCudaIsAnErrorWithTheOpsMessage) {
  if (meshfuse::built_with_cuda()) GTEST_SKIP() << "this build has the cuda backend";
  expect_usage_error(std::string(kSmallSwiglu) + " --backend cuda",
                     "swiglu: kernel backend 'cuda' (forced) has no kernel for this op in this "
                     "build (device cpu, dtype bf16)");
  expect_usage_error(std::string(kSmallSwiglu) + " --device cuda",
                     "--device: device cuda:0 is not available: this build has no cuda backend "
                     "(available: cpu)");
  expect_usage_error(std::string(kSmallSwiglu) + " --device tpu",
                     "device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'");
  expect_usage_error(std::string(kSmallSwiglu) + " --backend fast",
                     "kernel backend: unknown name 'fast' (expected one of reference, cpu, cuda)");
}

TEST(Cli, NoSubcommandIsAUsageError) {
  const CliResult r = run_cli("");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "subcommand")) << r.err;
}

}  // namespace

namespace {

// A model small enough for a test: H 32, I 88 and V 203, neither a multiple of 3 ranks.
std::string tiny_model(const ScratchDir& dir) {
  const fs::path path = dir.path() / "tiny.json";
  std::ofstream(path) << R"({"hidden_size": 32, "intermediate_size": 88, "num_attention_heads": 2,
                             "vocab_size": 203, "rms_norm_eps": 1e-5})";
  return path.string();
}

}  // namespace

TEST(Cli, RunChecksEveryOutputAndGradientOfTheShardedProgramAgainstOneDevice) {
  const ScratchDir dir;
  const CliResult r = run_cli("run --model " + tiny_model(dir) +
                              " --ranks 3 --tokens 10 --dtype f32 --repeats 1 --dump-plan");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "3 rank(s) on local (cpu)")) << r.out;
  EXPECT_TRUE(contains(r.out, "all_gather(dim 0) on local, mesh dim 0, team [0 1 2]")) << r.out;
  EXPECT_TRUE(contains(r.out, "reduce_scatter(sum, dim 0) on local")) << r.out;
  EXPECT_TRUE(contains(r.out, "fused_linear_cross_entropy(")) << r.out;
  EXPECT_TRUE(contains(r.out, "with all_gather of its row statistics on local")) << r.out;
  for (const char* output : {"loss", "y", "grad x", "grad head_weight", "grad norm_weight"})
    EXPECT_TRUE(contains(r.out, fmt::format("  {:<24}", output))) << output << "\n" << r.out;
  EXPECT_FALSE(contains(r.out, "FAIL")) << r.out;
}

TEST(Cli, RunJsonHasTimesCollectivesAndChecks) {
  const ScratchDir dir;
  const CliResult r = run_cli("run --model " + tiny_model(dir) +
                              " --ranks 2 --tokens 7 --repeats 1 --format json --dump-plan");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ranks"], 2);
  EXPECT_NE(j["plan"].get<std::string>().find("all_gather"), std::string::npos) << j["plan"];
  EXPECT_EQ(j["backend"], "local");
  EXPECT_EQ(j["per_rank"].size(), 2u);
  EXPECT_GT(j["collectives"].size(), 0u);
  EXPECT_EQ(j["checks"].size(), 9u);
  EXPECT_TRUE(j["pass"].get<bool>());
}

// At 256 tokens the tiny model's lowering gathers weights, not tokens: no stretch to overlap, which
// the run says instead of leaving the overlap table out without a word.
TEST(Cli, RunSaysWhenThePlanHasNoStretchToOverlap) {
  const ScratchDir dir;
  const std::string run = "run --model " + tiny_model(dir) +
                          " --ranks 3 --tokens 256 --repeats 1 --overlap collective --chunks 2";
  const CliResult r = run_cli(run);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "overlap collective: the plan has no stretch to overlap")) << r.out;
  const CliResult j = run_cli(run + " --format json");
  ASSERT_EQ(j.exit_code, 0) << j.out << j.err;
  EXPECT_EQ(nlohmann::json::parse(j.out)["layers"], nlohmann::json::array());
  EXPECT_EQ(nlohmann::json::parse(j.out)["overlap"]["chunks"], 2);
  // The default is one chunk per rank, as the table says (the JSON said 0).
  const CliResult d = run_cli("run --model " + tiny_model(dir) +
                              " --ranks 3 --tokens 256 --repeats 1 --overlap collective "
                              "--format json");
  ASSERT_EQ(d.exit_code, 0) << d.out << d.err;
  EXPECT_EQ(nlohmann::json::parse(d.out)["overlap"]["chunks"], 3);
}

// The spec that meshfuse launch --backend passes on in MESHFUSE_BACKEND gives the backend of the
// command's device (it was an "unknown name" before, not saying where the name came from).
// A pinned target better than this CPU's best is named with the one that runs instead (it once
// fell back without a word).
TEST(Cli, APinnedCpuTargetThisCpuLacksIsNamedWithTheOneThatRuns) {
  if (std::getenv("MESHFUSE_CPU_TARGET")) GTEST_SKIP() << "MESHFUSE_CPU_TARGET is set here";
  const std::string runs = meshfuse::cpu_simd_target();
  const std::string best = meshfuse::cpu_simd_targets().front();
  if (best == runs) GTEST_SKIP() << "this CPU has every target of the build";
  const CliResult r = run_cli("info", "MESHFUSE_CPU_TARGET=" + best);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, fmt::format("meshfuse: MESHFUSE_CPU_TARGET={}: this CPU lacks it; {} "
                                          "runs",
                                          best, runs)))
      << r.err;
  EXPECT_TRUE(contains(r.out, "cpu simd: " + runs)) << r.out;
}

TEST(Cli, RunTakesABackendSpecFromTheEnvironmentForItsDevice) {
  const ScratchDir dir;
  const std::string run = "run --model " + tiny_model(dir) + " --ranks 2 --tokens 4 --repeats 1";
  const CliResult r = run_cli(run + " --dtype f32 --format json", "MESHFUSE_BACKEND=cpu:local");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["backend"], "local");
  const CliResult cuda_only = run_cli(run, "MESHFUSE_BACKEND=cuda:nccl");
  EXPECT_EQ(cuda_only.exit_code, 2) << cuda_only.err;
  EXPECT_TRUE(contains(cuda_only.err,
                       "MESHFUSE_BACKEND=cuda:nccl (meshfuse launch --backend "
                       "sets it): "))
      << cuda_only.err;
  EXPECT_TRUE(contains(cuda_only.err, "cpu")) << cuda_only.err;
}

TEST(Cli, RunRejectsBadOptionsNamingThem) {
  const ScratchDir dir;
  const std::string model = tiny_model(dir);
  expect_usage_error("run --model " + model + " --backend carrier-pigeon",
                     "[invalid argument] --backend: communicator backend: unknown name");
  expect_usage_error("run --model " + model + " --dtype f16", "--dtype: expected bf16 or f32");
  expect_usage_error("run --model " + model + " --tokens -3", "--tokens");
  expect_usage_error("run --model " + model + " --tokens 0", "--tokens: expected >= 1, got 0");
  for (const char* word : {"abc", "2.5"})  // CLI::Range called them out of range
    expect_usage_error("run --model " + model + " --tokens " + word,
                       fmt::format("--tokens: expected a whole number from 1 to "
                                   "9223372036854775807, got '{}'",
                                   word));
  expect_usage_error("run --model " + model + " --ranks -2", "--ranks");
  expect_usage_error("run --model " + model + " --ranks 0", "--ranks");  // not the default 4
  expect_usage_error("run --model " + model + " --repeats 0", "--repeats: expected >= 1, got 0");
  expect_usage_error("run --model " + model + " --streams 0", "--streams: expected >= 1, got 0");
  // Chunks without the overlap that takes them would be silently ignored.
  expect_usage_error("run --model " + model + " --chunks 5",
                     "--chunks 5: only --overlap collective takes chunks");
  expect_usage_error("run --model " + model + " --overlap ring --chunks 5", "got --overlap ring");
  // Without a launcher gloo's job is one rank, where the local default runs four.
  if (meshfuse::communicator_backend_built(meshfuse::CommunicatorBackend::Gloo))
    expect_usage_error("run --model " + model + " --backend gloo",
                       "--backend: gloo's ranks come from a launcher, and this process was "
                       "started without one (a job of one rank); start them with meshfuse launch "
                       "-n N, torchrun or mpirun");
}
