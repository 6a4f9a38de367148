// The argument check of CrossEntropyOptions, shared by cross_entropy and
// fused_linear_cross_entropy (internal).
#pragma once

#include <string_view>

#include "meshfuse/ops/cross_entropy.h"

namespace meshfuse::detail {

// Throws Error(InvalidArgument) naming `op` and the option: label_smoothing outside [0, 1],
// logits_multiplier or z_loss_scale not finite.
void check_cross_entropy_options(std::string_view op, const CrossEntropyOptions& options);

}  // namespace meshfuse::detail
