// The meshfuse CLI: `info` and `bench`.
#include <CLI/CLI.hpp>

#include <iostream>

#include "meshfuse/meshfuse.h"

int main(int argc, char** argv) {
  CLI::App app{"meshfuse: transformer kernels on any accelerator"};
  app.require_subcommand(1);
  app.add_subcommand("info", "version, build options, devices, kernel backends");
  CLI11_PARSE(app, argc, argv);
  return 0;
}
