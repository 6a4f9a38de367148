// Sharding strategies of the Program's ops and their backward ops.
#include "meshfuse/exec/sharding.h"

#include <algorithm>

#include "meshfuse/exec/autodiff.h"
#include "test_util.h"

namespace meshfuse {
namespace {

bool offers(const std::vector<ShardingStrategy>& strategies, const ShardingStrategy& s) {
  return std::find(strategies.begin(), strategies.end(), s) != strategies.end();
}

const Placement R = Replicate{};
const Placement P = Partial{};
Placement S(std::int64_t d) { return Shard{d}; }

TEST(Sharding, LinearIsColumnParallelAndWithoutBiasRowParallel) {
  Program p;
  const Value x = p.define_tensor("x", {8, 16}, DType::F32);
  const Value w = p.define_tensor("w", {32, 16}, DType::F32);
  const Value b = p.define_tensor("b", {32}, DType::F32);
  p.linear(x, w, b);
  p.linear(x, w);
  const auto with_bias = sharding_strategies(p, p.ops()[0]);
  const auto without = sharding_strategies(p, p.ops()[1]);
  EXPECT_EQ(with_bias.front(), (ShardingStrategy{{R, R, R}, {R}}));
  EXPECT_TRUE(offers(with_bias, {{R, S(0), S(0)}, {S(1)}}));  // column-parallel
  EXPECT_TRUE(offers(with_bias, {{S(0), R, R}, {S(0)}}));     // tokens
  EXPECT_FALSE(offers(with_bias, {{S(1), S(1), R}, {P}}));    // the bias would count d times
  EXPECT_TRUE(offers(without, {{S(1), S(1), R}, {P}}));       // row-parallel
  EXPECT_TRUE(offers(without, {{P, R, R}, {P}}));
}

TEST(Sharding, NormsKeepTheirRowsWholeAndLossesShardTokens) {
  Program p;
  const Value x = p.define_tensor("x", {8, 16}, DType::F32);
  const Value w = p.define_tensor("w", {16}, DType::F32);
  const Value labels = p.define_tensor("labels", {8}, DType::I64);
  p.rmsnorm(x, w, 1e-5);
  p.cross_entropy(x, labels, {.reduction = Reduction::None});
  p.cross_entropy(x, labels, {.reduction = Reduction::Sum});
  p.cross_entropy(x, labels);
  const auto norm = sharding_strategies(p, p.ops()[0]);
  // Results: y and its rstd; the loss and its lse.
  EXPECT_EQ(norm, (std::vector<ShardingStrategy>{{{R, R}, {R, R}}, {{S(0), R}, {S(0), S(0)}}}));
  EXPECT_TRUE(offers(sharding_strategies(p, p.ops()[1]), {{S(0), S(0)}, {S(0), S(0)}}));
  EXPECT_TRUE(offers(sharding_strategies(p, p.ops()[2]), {{S(0), S(0)}, {P, S(0)}}));
  // Mean: replicated, or vocabulary-parallel (the op all-gathers its row statistics); not on rows.
  const auto mean = sharding_strategies(p, p.ops()[3]);
  EXPECT_EQ(mean.size(), 2u);
  EXPECT_TRUE(offers(mean, {{S(1), R}, {R, R}, true}));
}

TEST(Sharding, AddKeepsAnyMatchingPlacementAndSwigluAllButPartial) {
  Program p;
  const Value a = p.define_tensor("a", {4, 6}, DType::BF16);
  p.add(a, a);
  p.swiglu(a, a);
  const auto add = sharding_strategies(p, p.ops()[0]);
  const auto swiglu = sharding_strategies(p, p.ops()[1]);
  EXPECT_EQ(add.size(), 4u);
  EXPECT_TRUE(offers(add, {{P, P}, {P}}));
  EXPECT_TRUE(offers(swiglu, {{S(1), S(1)}, {S(1)}}));
  EXPECT_FALSE(offers(swiglu, {{P, P}, {P}}));
}

TEST(Sharding, BackwardOpsMirrorTheirForwardAndReplicatedWeightsGetPartialGradients) {
  Program p;
  const Value x = p.define_tensor("x", {8, 16}, DType::F32);
  const Value w = p.define_tensor("w", {32, 16}, DType::F32);
  const Value n = p.define_tensor("n", {16}, DType::F32);
  const Program j = grad(
      [&] {
        Program q = p;
        q.add_output(q.linear(q.rmsnorm(x, n, 1e-5), w));
        return q;
      }(),
      Value{5}, {x, w, n});
  const ProgramOp& linear_backward = j.ops()[2];
  const ProgramOp& rmsnorm_backward = j.ops()[3];
  ASSERT_EQ(linear_backward.type, OpType::LinearBackward);
  ASSERT_EQ(rmsnorm_backward.type, OpType::RmsNormBackward);
  const auto lb = sharding_strategies(j, linear_backward);
  EXPECT_TRUE(offers(lb, {{S(0), S(0), R, R}, {S(0), P}}));     // tokens: weight grad summed
  EXPECT_TRUE(offers(lb, {{S(1), R, S(0), S(0)}, {P, S(0)}}));  // column-parallel
  EXPECT_TRUE(offers(lb, {{R, S(1), S(1), R}, {S(1), S(1)}}));  // row-parallel
  EXPECT_TRUE(offers(sharding_strategies(j, rmsnorm_backward), {{S(0), S(0), R, S(0)}, {S(0), P}}));
}

}  // namespace
}  // namespace meshfuse
