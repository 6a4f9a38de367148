// The model-config parser (a Hugging Face config.json) on arbitrary text: it throws
// meshfuse::Error or returns a config whose sizes are all usable.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "meshfuse/core/error.h"
#include "model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const meshfuse::cli::ModelConfig m = meshfuse::cli::parse_model_config(text, "fuzz");
    const bool usable = m.hidden_size > 0 && m.intermediate_size > 0 &&
                        m.num_attention_heads > 0 && m.num_key_value_heads > 0 &&
                        m.head_dim > 0 && m.vocab_size > 0 && m.rms_norm_eps >= 0 &&
                        std::isfinite(m.rms_norm_eps);
    if (!usable) std::abort();
  } catch (const meshfuse::Error&) {
  }
  return 0;
}
