// The op options that Python passes as strings (internal to the _meshfuse extension): shared by the
// ops' bindings (module.cpp) and the Program builder's (exec.cpp), so both spell them alike.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "meshfuse/core/error.h"
#include "meshfuse/distributed/communicator.h"
#include "meshfuse/ops/cross_entropy.h"
#include "meshfuse/ops/swiglu.h"

namespace meshfuse::python {

inline SwigluLayout parse_layout(const std::string& name, std::string_view op) {
  if (name == "halves") return SwigluLayout::Halves;
  if (name == "interleaved") return SwigluLayout::Interleaved;
  throw Error(ErrorCode::InvalidArgument,
              std::string(op) + ": layout must be 'halves' or 'interleaved', got '" + name + "'");
}

// parse(name), its error prefixed with `op`.
template <typename Parse>
auto parse_option(std::string_view op, const std::string& name, Parse parse) {
  try {
    return parse(name);
  } catch (const Error& e) {
    throw Error(e.code(), std::string(op) + ": " + e.message());
  }
}

// A reduction op by name ('sum', 'avg', ...); errors name `op` and its argument 'op'.
inline ReduceOp parse_reduce_op_arg(const std::string& name, std::string_view op) {
  return parse_option(std::string(op) + ": 'op'", name,
                      [](const std::string& n) { return parse_reduce_op(n); });
}

// `op` names the caller in errors.
inline CrossEntropyOptions ce_options(std::string_view op, std::int64_t ignore_index,
                                      const std::string& reduction, double label_smoothing,
                                      double logits_multiplier, double z_loss_scale,
                                      std::int64_t vocab_start = 0, std::int64_t vocab_size = 0,
                                      const std::string& label_check = "raise") {
  return {.ignore_index = ignore_index,
          .reduction = parse_option(op, reduction, parse_reduction),
          .label_smoothing = label_smoothing,
          .logits_multiplier = logits_multiplier,
          .z_loss_scale = z_loss_scale,
          .vocab_start = vocab_start,
          .vocab_size = vocab_size,
          .label_check = parse_option(op, label_check, parse_label_check)};
}

}  // namespace meshfuse::python
