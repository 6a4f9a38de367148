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
  m.def(
      "pack_sequence",
      [](In x, In cu_seqlens, Out out, const std::string& padding_side, std::uintptr_t stream) {
        pack_sequence(
            view(x, "pack_sequence", "x"), view(cu_seqlens, "pack_sequence", "cu_seqlens"),
            view(out, "pack_sequence", "out"), parse_padding_side("pack_sequence", padding_side),
            stream_on(device_of(x), stream));
      },
      "x"_a, "cu_seqlens"_a, "out"_a, "padding_side"_a = "left", "stream"_a = 0, release,
      "out (T, ...) = the tokens of each padded row of x (B, S, ...), sequence after sequence, "
      "as cu_seqlens (B+1,) int32/uint32/int64 gives them; padding_side 'left' (tokens at the "
      "end of each row) or 'right'. Any dtype. Raises meshfuse.Error subclasses: "
      "ShapeMismatchError, InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), "
      "DeviceMismatchError, BackendUnavailableError (RuntimeError). Spec: "
      "meshfuse/ops/pack_sequence.h. Outputs are caller-allocated arrays written in place; "
      "`stream` is a cudaStream_t as an integer on the arrays' device (0: its default stream).");
  m.def(
      "unpack_sequence",
      [](In x, In cu_seqlens, Out out, const std::string& padding_side, std::uintptr_t stream) {
        unpack_sequence(
            view(x, "unpack_sequence", "x"), view(cu_seqlens, "unpack_sequence", "cu_seqlens"),
            view(out, "unpack_sequence", "out"),
            parse_padding_side("unpack_sequence", padding_side), stream_on(device_of(x), stream));
      },
      "x"_a, "cu_seqlens"_a, "out"_a, "padding_side"_a = "left", "stream"_a = 0, release,
      "The inverse of pack_sequence: x (T, ...) into out (B, S, ...), the padding zero-filled. "
      "Raises meshfuse.Error subclasses: ShapeMismatchError, InvalidArgumentError (ValueError), "
      "DTypeMismatchError (TypeError), DeviceMismatchError, BackendUnavailableError "
      "(RuntimeError). Spec: meshfuse/ops/pack_sequence.h. Outputs are caller-allocated arrays "
      "written in place; `stream` is a cudaStream_t as an integer on the arrays' device (0: its "
      "default stream).");
  m.def(
      "continuous_count",
      [](In x, Out out, std::uintptr_t stream) {
        continuous_count(view(x, "continuous_count", "x"), view(out, "continuous_count", "out"),
                         stream_on(device_of(x), stream));
      },
      "x"_a, "out"_a, "stream"_a = 0, release,
      "out (bins,) int64 = the count of each value of the 1-D int32/int64 x in [0, bins); "
      "values outside are ignored. Raises meshfuse.Error subclasses: ShapeMismatchError, "
      "InvalidArgumentError (ValueError), DTypeMismatchError (TypeError), DeviceMismatchError, "
      "BackendUnavailableError (RuntimeError). Spec: meshfuse/ops/continuous_count.h. Outputs "
      "are caller-allocated arrays written in place; `stream` is a cudaStream_t as an integer "
      "on the arrays' device (0: its default stream).");
}

}  // namespace meshfuse::python
