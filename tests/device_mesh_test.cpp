// DeviceMesh and placements: coordinates, teams, shard sizes and the local part of a placed tensor.
#include "meshfuse/distributed/device_mesh.h"

#include "meshfuse/exec/placement.h"
#include "test_util.h"

namespace meshfuse {
namespace {

using test::expect_error;

TEST(DeviceMesh, ATwoDimensionalMeshGivesCoordinatesRanksAndTeamsAlongEachDimension) {
  const DeviceMesh mesh = DeviceMesh::of_shape({2, 3});
  EXPECT_EQ(mesh.ndim(), 2);
  EXPECT_EQ(mesh.numel(), 6);
  EXPECT_EQ(mesh.size(-1), 3);
  EXPECT_EQ(mesh.coordinates(4), (std::vector<std::int64_t>{1, 1}));
  EXPECT_EQ(mesh.rank_at({1, 2}), 5);
  EXPECT_EQ(mesh.team(0, 4), (std::vector<int>{1, 4}));  // the data-parallel replicas
  EXPECT_EQ(mesh.team(1, 4), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(mesh.team(-1, 4), mesh.team(1, 4));
  EXPECT_EQ(mesh.to_string(), "DeviceMesh([2, 3], ranks [0, 1, 2, 3, 4, 5])");
  // Any ranks of a team, in row-major order.
  const DeviceMesh odd({7, 5, 6, 4}, {2, 2});
  EXPECT_EQ(odd.coordinates(6), (std::vector<std::int64_t>{1, 0}));
  EXPECT_EQ(odd.team(0, 5), (std::vector<int>{5, 4}));
  EXPECT_TRUE(odd.contains(4));
  EXPECT_FALSE(odd.contains(0));
  EXPECT_EQ(DeviceMesh({3, 1}).shape(), (std::vector<std::int64_t>{2}));
}

TEST(DeviceMesh, RanksOutsideTheMeshAndBadShapesAreErrors) {
  const DeviceMesh mesh = DeviceMesh::of_shape({2, 2});
  expect_error([&] { mesh.coordinates(4); }, ErrorCode::InvalidArgument,
               {"rank 4 is not in DeviceMesh([2, 2]"});
  expect_error([&] { mesh.team(0, 9); }, ErrorCode::InvalidArgument, {"rank 9"});
  expect_error(
      [&] {
        mesh.rank_at({2, 0});
      },
      ErrorCode::InvalidArgument, {"coordinates [2, 0] are outside"});
  expect_error([&] { mesh.rank_at({0}); }, ErrorCode::InvalidArgument, {"1 coordinates", "2-D"});
  expect_error([&] { mesh.size(2); }, ErrorCode::InvalidArgument, {"dimension 2", "2-D"});
  expect_error(
      [] {
        DeviceMesh({0, 1, 2}, {2, 2});
      },
      ErrorCode::InvalidArgument, {"[2, 2] holds 4 ranks, got 3"});
  expect_error([] { DeviceMesh({0, 0}); }, ErrorCode::InvalidArgument, {"distinct", "[0, 0]"});
  expect_error([] { DeviceMesh::of_shape({2, 0}); }, ErrorCode::InvalidArgument, {">= 1"});
  expect_error([] { DeviceMesh::of_shape({}); }, ErrorCode::InvalidArgument, {"one dimension"});
}

TEST(Placement, ShardRangesAreAsEvenAsPossibleWithTheLongerPartsFirst) {
  std::vector<ShardRange> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(shard_range(10, 4, i));
  EXPECT_EQ(parts, (std::vector<ShardRange>{{0, 3}, {3, 3}, {6, 2}, {8, 2}}));
  EXPECT_EQ(shard_range(2, 4, 3), (ShardRange{2, 0}));  // fewer rows than ranks: empty parts last
  EXPECT_EQ(shard_range(0, 3, 1), (ShardRange{0, 0}));
  EXPECT_EQ(shard_range(std::int64_t{1} << 40, 3, 2).size, ((std::int64_t{1} << 40) / 3));
  expect_error([] { shard_range(4, 2, 2); }, ErrorCode::InvalidArgument, {"part 2 of 2 parts"});
  expect_error([] { shard_range(4, 0, 0); }, ErrorCode::InvalidArgument, {"0 parts"});
}

TEST(Placement, TheLocalPartFollowsEachMeshDimensionsPlacement) {
  const DeviceMesh mesh = DeviceMesh::of_shape({2, 3});
  // Rank 4 is at (1, 1).
  LocalPart p = local_part({10, 6}, mesh, {Shard{0}, Shard{-1}}, 4);
  EXPECT_EQ(p.shape, (Shape{5, 2}));
  EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{5, 2}));
  p = local_part({10, 6}, mesh, {Replicate{}, Shard{1}}, 4);
  EXPECT_EQ(p.shape, (Shape{10, 2}));
  EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{0, 2}));
  p = local_part({10, 6}, mesh, {Partial{}, Replicate{}}, 4);
  EXPECT_EQ(p.shape, (Shape{10, 6}));
  // Both mesh dimensions on tensor dim 0: 10 rows over 2, then that part's 5 over 3.
  p = local_part({10}, mesh, {Shard{0}, Shard{0}}, 4);
  EXPECT_EQ(p.shape, (Shape{2}));
  EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{7}));
  EXPECT_EQ(to_string(Placement{Shard{-1}}), "Shard(-1)");
  EXPECT_EQ(to_string(Placement{Replicate{}}), "Replicate()");
  EXPECT_EQ(to_string(Placement{Partial{ReduceOp::Max}}), "Partial(max)");
  expect_error([&] { local_part({10}, mesh, {Shard{0}}, 4); }, ErrorCode::InvalidArgument,
               {"1 placements", "one per mesh dimension"});
  expect_error(
      [&] {
        local_part({10}, mesh, {Shard{1}, Replicate{}}, 4);
      },
      ErrorCode::InvalidArgument, {"Shard(1)", "mesh dimension 0", "[10]"});
  expect_error(
      [&] {
        local_part({10}, mesh, {Replicate{}, Replicate{}}, 6);
      },
      ErrorCode::InvalidArgument, {"rank 6 is not in"});
}

}  // namespace
}  // namespace meshfuse
