// The meshfuse CLI: `info` and `bench`.
//
// Exit codes: 0 success; 1 a bench check failed; 2 bad arguments, a bad model config, or a
// device / backend this build or machine does not have (the message says which); 3 an unexpected
// internal error.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "bench.h"
#include "info.h"
#include "meshfuse/core/error.h"

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
                   "a shipped model (configs/models/NAME.json) or the path of a Hugging Face "
                   "config.json")
      ->required();
  bench->add_option("--tokens", bench_options.tokens, "rows (tokens) per call")
      ->capture_default_str();
  bench->add_option("--dtype", bench_options.dtype, "bf16, f16 or f32")->capture_default_str();
  bench->add_option("--device", bench_options.device, "cpu, or cuda[:N] in CUDA builds")
      ->capture_default_str();
  bench
      ->add_option("--backend", bench_options.backend,
                   "auto (the device's own), reference, cpu or cuda")
      ->capture_default_str();
  bench->add_option("--ops", bench_options.ops,
                    "comma-separated ops to run (default: all; an unknown name lists them)");
  bench->add_option("--format", bench_options.format, "table, csv or json")->capture_default_str();
  bench
      ->add_option("--repeats", bench_options.repeats,
                   "timed calls per op and direction (fewer for slow calls)")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
    if (*info) {
      meshfuse::cli::print_info(std::cout);
      return 0;
    }
    return meshfuse::cli::run_bench(bench_options, std::cout);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message and a pointer to --help
    return 2;
  } catch (const meshfuse::Error& e) {
    fmt::print(stderr, "meshfuse: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshfuse: internal error: {}\n", e.what());
    return 3;
  }
}
