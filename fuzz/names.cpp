// Every parser of names and specs (backend specs, devices, dtypes, collectives, reductions, overlap
// forms, kernel backends, the launch environment) on arbitrary text: each throws meshfuse::Error
// (or returns nullopt where it says so) or returns a value that prints back to what parses to it.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

#include "meshfuse/meshfuse.h"

namespace {

using namespace meshfuse;

void expect(bool ok) {
  if (!ok) std::abort();
}

template <typename F>
void parse(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int which = in.ConsumeIntegralInRange(0, 8);
  const std::string text = in.ConsumeRemainingBytesAsString();
  switch (which) {
    case 0:
      parse([&] {
        const BackendSpec spec = BackendSpec::parse(text);
        expect(BackendSpec::parse(spec.str()).str() == spec.str());
      });
      break;
    case 1:
      parse([&] {
        const Device d = Device::parse(text);
        expect(Device::parse(d.str()) == d);
      });
      break;
    case 2:
      if (const auto dtype = parse_dtype(text)) expect(parse_dtype(to_string(*dtype)) == dtype);
      break;
    case 3:
      parse([&] { expect(parse_comm_op(to_string(parse_comm_op(text))) == parse_comm_op(text)); });
      break;
    case 4:
      parse([&] { expect(parse_reduce_op(to_string(parse_reduce_op(text))) == parse_reduce_op(text)); });
      break;
    case 5:
      parse([&] { expect(parse_overlap(to_string(parse_overlap(text))) == parse_overlap(text)); });
      break;
    case 6:
      parse([&] {
        expect(parse_reduction(to_string(parse_reduction(text))) == parse_reduction(text));
      });
      break;
    case 7:
      parse([&] {
        const KernelBackend b = parse_kernel_backend(text);
        expect(parse_kernel_backend(to_string(b)) == b);
      });
      break;
    case 8: {  // NAME=value lines, as a launcher's environment
      std::map<std::string, std::string> env;
      std::size_t at = 0;
      while (at < text.size()) {
        std::size_t end = text.find('\n', at);
        if (end == std::string::npos) end = text.size();
        const std::string line = text.substr(at, end - at);
        const std::size_t eq = line.find('=');
        if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
        at = end + 1;
      }
      parse([&] {
        const LaunchInfo info = parse_launch_env(env);
        expect(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size &&
               info.local_rank >= 0 && info.local_rank < info.local_world_size);
      });
      break;
    }
  }
  return 0;
}
