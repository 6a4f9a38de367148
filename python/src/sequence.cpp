// pack_sequence, unpack_sequence and continuous_count in the _meshfuse extension: arrays in,
// caller-allocated outputs written in place, the GIL released while they run.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "arrays.h"
#include "meshfuse/ops/continuous_count.h"
#include "meshfuse/ops/pack_sequence.h"

namespace meshfuse::python {
namespace {

using namespace nb::literals;
using In = nb::ndarray<nb::ro>;
using Out = Output;

PaddingSide parse_padding_side(const char* op, const std::string& name) {
  if (name == "left") return PaddingSide::Left;
  if (name == "right") return PaddingSide::Right;
  throw Error(ErrorCode::InvalidArgument,
              std::string(op) + ": padding_side must be 'left' or 'right', got '" + name + "'");
}

}  // namespace

void bind_sequence(nb::module_& m) {
  const auto release = nb::call_guard<nb::gil_scoped_release>();
  m.def("pack_sequence", [](In x, In cu_seqlens, Out out, const std::string& padding_side,
                            std::uintptr_t stream) {
    pack_sequence(view(x), view(cu_seqlens), view(out, "out"),
                  parse_padding_side("pack_sequence", padding_side),
                  stream_on(device_of(x), stream));
  }, "x"_a, "cu_seqlens"_a, "out"_a, "padding_side"_a = "left", "stream"_a = 0, release);
  m.def("unpack_sequence", [](In x, In cu_seqlens, Out out, const std::string& padding_side,
                              std::uintptr_t stream) {
    unpack_sequence(view(x), view(cu_seqlens), view(out, "out"),
                    parse_padding_side("unpack_sequence", padding_side),
                    stream_on(device_of(x), stream));
  }, "x"_a, "cu_seqlens"_a, "out"_a, "padding_side"_a = "left", "stream"_a = 0, release);
  m.def("continuous_count", [](In x, Out out, std::uintptr_t stream) {
    continuous_count(view(x), view(out, "out"), stream_on(device_of(x), stream));
  }, "x"_a, "out"_a, "stream"_a = 0, release);
}

}  // namespace meshfuse::python
