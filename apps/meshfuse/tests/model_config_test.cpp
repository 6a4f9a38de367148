// Reading Hugging Face config.json files for `meshfuse bench --model`.
#include "model_config.h"

#include <gtest/gtest.h>

#include "meshfuse/core/error.h"

namespace meshfuse::cli {
namespace {

// The error message of f(), which must throw meshfuse::Error(InvalidArgument).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(ModelConfig, ShippedLlamaConfigGivesItsShapes) {
  const ModelConfig m = load_model_config("llama-3.2-1b");
  EXPECT_EQ(m.name, "llama-3.2-1b");
  EXPECT_EQ(m.hidden_size, 2048);
  EXPECT_EQ(m.intermediate_size, 8192);
  EXPECT_EQ(m.num_attention_heads, 32);
  EXPECT_EQ(m.num_key_value_heads, 8);
  EXPECT_EQ(m.head_dim, 64);
  EXPECT_EQ(m.vocab_size, 128256);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-5);
}

TEST(ModelConfig, APathIsReadDirectlyAndNamedByItsFile) {
  const ModelConfig m = load_model_config(MESHFUSE_CONFIG_DIR "/qwen2.5-7b.json");
  EXPECT_EQ(m.name, "qwen2.5-7b");
  EXPECT_EQ(m.vocab_size, 152064);
}

TEST(ModelConfig, HeadDimDefaultsToHiddenOverHeadsAndKvHeadsToHeads) {
  const ModelConfig m = parse_model_config(
      R"({"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
          "vocab_size": 32000})",
      "inline");
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.num_key_value_heads, 32);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-6);
}

TEST(ModelConfig, EveryShippedModelLoads) {
  const std::vector<std::string> names = known_models();
  EXPECT_GE(names.size(), 5u);
  for (const std::string& name : names) EXPECT_NO_THROW(load_model_config(name)) << name;
}

TEST(ModelConfig, MissingKeyIsNamedWithWhatWasExpected) {
  const std::string msg = error_of([] {
    parse_model_config(R"({"intermediate_size": 8, "num_attention_heads": 2, "vocab_size": 4})",
                       "cfg.json");
  });
  EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing key 'hidden_size' (expected a positive integer)"), std::string::npos)
      << msg;
}

TEST(ModelConfig, NonIntegerValueIsNamedWithWhatCame) {
  const std::string msg = error_of([] {
    parse_model_config(R"({"hidden_size": "big", "intermediate_size": 8,
                           "num_attention_heads": 2, "vocab_size": 4})",
                       "cfg.json");
  });
  EXPECT_NE(msg.find("'hidden_size' must be a positive integer, got \"big\""), std::string::npos)
      << msg;
}

TEST(ModelConfig, NegativeSizeIsRejected) {
  const std::string msg = error_of([] {
    parse_model_config(R"({"hidden_size": 8, "intermediate_size": -8,
                           "num_attention_heads": 2, "vocab_size": 4})",
                       "cfg.json");
  });
  EXPECT_NE(msg.find("'intermediate_size' must be a positive integer, got -8"), std::string::npos)
      << msg;
}

TEST(ModelConfig, HiddenNotAMultipleOfHeadsWithoutHeadDimIsRejected) {
  const std::string msg = error_of([] {
    parse_model_config(R"({"hidden_size": 10, "intermediate_size": 8,
                           "num_attention_heads": 3, "vocab_size": 4})",
                       "cfg.json");
  });
  EXPECT_NE(msg.find("hidden_size (10) must be a multiple of num_attention_heads (3)"),
            std::string::npos)
      << msg;
}

TEST(ModelConfig, MalformedJsonSaysSo) {
  const std::string msg = error_of([] { parse_model_config("{\"hidden_size\": ", "cfg.json"); });
  EXPECT_NE(msg.find("model config cfg.json: not valid JSON"), std::string::npos) << msg;
}

// Found by fuzz/model_config.cpp: nlohmann's out_of_range escaped as an internal error.
TEST(ModelConfig, ANumberTooLargeForADoubleIsMalformedJson) {
  const std::string what = error_of([] { parse_model_config(R"({"hidden_size": 8e9999})", "t"); });
  EXPECT_NE(what.find("not valid JSON"), std::string::npos) << what;
  EXPECT_NE(what.find("number overflow"), std::string::npos) << what;
}

TEST(ModelConfig, JsonThatIsNotAnObjectSaysWhatCame) {
  const std::string msg = error_of([] { parse_model_config("[1, 2]", "cfg.json"); });
  EXPECT_NE(msg.find("expected a JSON object"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got array"), std::string::npos) << msg;
}

TEST(ModelConfig, UnknownNameListsTheShippedModels) {
  const std::string msg = error_of([] { load_model_config("llama-9"); });
  EXPECT_NE(msg.find("no model named 'llama-9'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llama-3.2-1b"), std::string::npos) << msg;
}

TEST(ModelConfig, MissingPathSaysItCannotBeRead) {
  const std::string msg = error_of([] { load_model_config("/nonexistent/config.json"); });
  EXPECT_NE(msg.find("cannot read the config file '/nonexistent/config.json'"), std::string::npos)
      << msg;
}

}  // namespace
}  // namespace meshfuse::cli
