// The model shapes the bench runs at, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace meshfuse::cli {

struct ModelConfig {
  std::string name;  // the name given, or the file's stem for a path
  std::filesystem::path path;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;  // HF default: num_attention_heads
  std::int64_t head_dim = 0;             // HF default: hidden_size / num_attention_heads
  std::int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;  // HF LlamaConfig's default
};

// The directories searched for <name>.json: an install's share/meshfuse/models (beside the
// binary's bin/), then the source tree's configs/models.
std::vector<std::filesystem::path> model_config_dirs();

// The names of the shipped configs (file stems), sorted.
std::vector<std::string> known_models();

// Reads `name_or_path`: an existing file, or a name looked up as <dir>/<name>.json in
// model_config_dirs(). Throws meshfuse::Error(InvalidArgument) naming the file and what was
// expected when the file is missing, is not JSON, or lacks a key or has a bad value for one.
ModelConfig load_model_config(std::string_view name_or_path);

// Parses the text of a config.json; `source` names it in error messages.
ModelConfig parse_model_config(std::string_view text, const std::string& source);

}  // namespace meshfuse::cli
