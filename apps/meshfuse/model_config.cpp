#include "model_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "meshfuse/core/error.h"

namespace meshfuse::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A required (or, with a fallback, optional) positive integer key.
std::int64_t positive_int(const json& config, const std::string& source, const char* key,
                          std::int64_t fallback = 0) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) {
    MESHFUSE_CHECK(fallback > 0, ErrorCode::InvalidArgument,
                   "model config {}: missing key '{}' (expected a positive integer)", source, key);
    return fallback;
  }
  MESHFUSE_CHECK(it->is_number_integer() && it->get<std::int64_t>() > 0, ErrorCode::InvalidArgument,
                 "model config {}: '{}' must be a positive integer, got {}", source, key,
                 it->dump());
  return it->get<std::int64_t>();
}

}  // namespace

std::vector<fs::path> model_config_dirs() {
  // An install's, then the source tree's (a build tree has no share/ beside its bin): an
  // installed <prefix>/bin/meshfuse reads <prefix>/share/meshfuse/models, and a pip install's
  // meshfuse/bin/meshfuse reads meshfuse/share/meshfuse/models, whether or not the tree it was
  // built from is still there.
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {MESHFUSE_CONFIG_DIR};  // no /proc: not a path relative to the working directory
  return {exe.parent_path().parent_path() / "share" / "meshfuse" / "models", MESHFUSE_CONFIG_DIR};
}

std::vector<std::string> known_models() {
  std::vector<std::string> names;
  for (const fs::path& dir : model_config_dirs()) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

ModelConfig parse_model_config(std::string_view text, const std::string& source) {
  json config;
  try {
    config = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number too large
    fail(ErrorCode::InvalidArgument, "model config {}: not valid JSON ({})", source, e.what());
  }
  MESHFUSE_CHECK(config.is_object(), ErrorCode::InvalidArgument,
                 "model config {}: expected a JSON object (a Hugging Face config.json), got {}",
                 source, config.type_name());
  ModelConfig m;
  m.hidden_size = positive_int(config, source, "hidden_size");
  m.intermediate_size = positive_int(config, source, "intermediate_size");
  m.num_attention_heads = positive_int(config, source, "num_attention_heads");
  m.num_key_value_heads =
      positive_int(config, source, "num_key_value_heads", m.num_attention_heads);
  m.vocab_size = positive_int(config, source, "vocab_size");
  MESHFUSE_CHECK(config.contains("head_dim") || m.hidden_size % m.num_attention_heads == 0,
                 ErrorCode::InvalidArgument,
                 "model config {}: without 'head_dim', hidden_size ({}) must be a multiple of "
                 "num_attention_heads ({})",
                 source, m.hidden_size, m.num_attention_heads);
  m.head_dim = positive_int(config, source, "head_dim", m.hidden_size / m.num_attention_heads);
  if (const auto eps = config.find("rms_norm_eps"); eps != config.end()) {
    MESHFUSE_CHECK(eps->is_number() && eps->get<double>() >= 0, ErrorCode::InvalidArgument,
                   "model config {}: 'rms_norm_eps' must be a number >= 0, got {}", source,
                   eps->dump());
    m.rms_norm_eps = eps->get<double>();
  }
  return m;
}

ModelConfig load_model_config(std::string_view name_or_path) {
  fs::path path{std::string(name_or_path)};
  const bool is_name = !fs::exists(path) && path.extension() != ".json" &&
                       name_or_path.find('/') == std::string_view::npos;
  if (is_name) {
    std::vector<std::string> tried;
    for (const fs::path& dir : model_config_dirs()) {
      const fs::path candidate = dir / (path.string() + ".json");
      if (fs::exists(candidate)) {
        path = candidate;
        break;
      }
      tried.push_back(candidate.string());
    }
    MESHFUSE_CHECK(fs::exists(path), ErrorCode::InvalidArgument,
                   "--model: no model named '{}' (looked for {}); expected one of: {}, or the "
                   "path of a config.json",
                   name_or_path, fmt::join(tried, ", "), fmt::join(known_models(), ", "));
  }
  std::ifstream file(path);
  MESHFUSE_CHECK(fs::is_regular_file(path) && file, ErrorCode::InvalidArgument,
                 "--model: cannot read the config file '{}' (expected a Hugging Face "
                 "config.json or one of: {})",
                 path.string(), fmt::join(known_models(), ", "));
  std::stringstream text;
  text << file.rdbuf();
  ModelConfig m = parse_model_config(text.str(), path.string());
  // A downloaded model directory holds "config.json": its directory names the model.
  const bool generic = path.stem() == "config" && path.has_parent_path();
  m.name = is_name ? std::string(name_or_path)
                   : (generic ? path.parent_path().filename() : path.stem()).string();
  m.path = path;
  return m;
}

}  // namespace meshfuse::cli
