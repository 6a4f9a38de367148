// The argument check of CrossEntropyOptions, shared by cross_entropy and
// fused_linear_cross_entropy (internal).
#pragma once

#include <cstdint>
#include <string_view>

#include "meshfuse/ops/cross_entropy.h"

namespace meshfuse::detail {

// Throws Error(InvalidArgument) naming `op` and the option: label_smoothing outside [0, 1],
// logits_multiplier or z_loss_scale not finite.
void check_cross_entropy_options(std::string_view op, const CrossEntropyOptions& options);

// Throws Error(InvalidArgument) naming `op` unless the logits' `vocab` columns from
// options.vocab_start lie in [0, options.vocab_size) (vocab_size 0: vocab, so vocab_start must
// be 0).
void check_vocab_shard(std::string_view op, const CrossEntropyOptions& options, std::int64_t vocab);

}  // namespace meshfuse::detail
