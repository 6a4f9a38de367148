#include "meshfuse/distributed/device_mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "meshfuse/core/error.h"

namespace meshfuse {

DeviceMesh::DeviceMesh(std::vector<int> ranks)
    : DeviceMesh(ranks, {static_cast<std::int64_t>(ranks.size())}) {}

DeviceMesh::DeviceMesh(std::vector<int> ranks, std::vector<std::int64_t> shape)
    : ranks_(std::move(ranks)), shape_(std::move(shape)) {
  MESHFUSE_CHECK(!shape_.empty(), ErrorCode::InvalidArgument,
                 "DeviceMesh: the shape must have at least one dimension");
  std::int64_t product = 1;
  for (std::int64_t s : shape_) {
    MESHFUSE_CHECK(s >= 1, ErrorCode::InvalidArgument,
                   "DeviceMesh: every size must be >= 1, got shape [{}]", fmt::join(shape_, ", "));
    product *= s;
  }
  MESHFUSE_CHECK(product == numel(), ErrorCode::InvalidArgument,
                 "DeviceMesh: shape [{}] holds {} ranks, got {} ([{}])", fmt::join(shape_, ", "),
                 product, numel(), fmt::join(ranks_, ", "));
  MESHFUSE_CHECK(std::set<int>(ranks_.begin(), ranks_.end()).size() == ranks_.size() &&
                     std::all_of(ranks_.begin(), ranks_.end(), [](int r) { return r >= 0; }),
                 ErrorCode::InvalidArgument,
                 "DeviceMesh: the ranks must be distinct and >= 0, got [{}]",
                 fmt::join(ranks_, ", "));
}

DeviceMesh DeviceMesh::of_shape(std::vector<std::int64_t> shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= std::max<std::int64_t>(s, 0);
  std::vector<int> ranks(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
  return DeviceMesh(std::move(ranks), std::move(shape));
}

std::int64_t DeviceMesh::checked_dim(std::int64_t dim) const {
  const std::int64_t d = dim < 0 ? dim + ndim() : dim;
  MESHFUSE_CHECK(d >= 0 && d < ndim(), ErrorCode::InvalidArgument,
                 "DeviceMesh: dimension {} is outside a {}-D mesh", dim, ndim());
  return d;
}

std::int64_t DeviceMesh::size(std::int64_t dim) const {
  return shape_[static_cast<std::size_t>(checked_dim(dim))];
}

bool DeviceMesh::contains(int rank) const {
  return std::find(ranks_.begin(), ranks_.end(), rank) != ranks_.end();
}

std::vector<std::int64_t> DeviceMesh::coordinates(int rank) const {
  const auto it = std::find(ranks_.begin(), ranks_.end(), rank);
  MESHFUSE_CHECK(it != ranks_.end(), ErrorCode::InvalidArgument, "DeviceMesh: rank {} is not in {}",
                 rank, to_string());
  std::int64_t index = it - ranks_.begin();
  std::vector<std::int64_t> c(shape_.size());
  for (std::size_t d = shape_.size(); d-- > 0;) {
    c[d] = index % shape_[d];
    index /= shape_[d];
  }
  return c;
}

int DeviceMesh::rank_at(const std::vector<std::int64_t>& coordinates) const {
  MESHFUSE_CHECK(coordinates.size() == shape_.size(), ErrorCode::InvalidArgument,
                 "DeviceMesh: {} coordinates for a {}-D mesh", coordinates.size(), ndim());
  std::int64_t index = 0;
  for (std::size_t d = 0; d < shape_.size(); ++d) {
    MESHFUSE_CHECK(coordinates[d] >= 0 && coordinates[d] < shape_[d], ErrorCode::InvalidArgument,
                   "DeviceMesh: coordinates [{}] are outside {}", fmt::join(coordinates, ", "),
                   to_string());
    index = index * shape_[d] + coordinates[d];
  }
  return ranks_[static_cast<std::size_t>(index)];
}

std::vector<int> DeviceMesh::team(std::int64_t dim, int rank) const {
  const std::size_t d = static_cast<std::size_t>(checked_dim(dim));
  std::vector<std::int64_t> c = coordinates(rank);
  std::vector<int> ranks;
  for (c[d] = 0; c[d] < shape_[d]; ++c[d]) ranks.push_back(rank_at(c));
  return ranks;
}

std::string DeviceMesh::to_string() const {
  return fmt::format("DeviceMesh([{}], ranks [{}])", fmt::join(shape_, ", "),
                     fmt::join(ranks_, ", "));
}

}  // namespace meshfuse
