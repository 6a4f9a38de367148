// DeviceMesh: ranks arranged in an n-dimensional grid (DTensor's DeviceMesh), the space that
// placements (exec/placement.h) lay tensors on. A 1-D mesh of d ranks shards over d; a 2-D
// (data x tensor) mesh holds a data-parallel replica per row and tensor-parallel ranks along it.
//
// The ranks are those of a Communicator's team, listed in row-major order of their coordinates.
// Errors: InvalidArgument (an empty mesh, a size < 1, ranks that do not fill the shape or repeat,
// a rank or coordinate outside the mesh: never a silent slice 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshfuse {

class DeviceMesh {
 public:
  // A 1-D mesh of `ranks`.
  explicit DeviceMesh(std::vector<int> ranks);
  // `ranks` laid out in row-major order over `shape` (its product must be ranks.size()).
  DeviceMesh(std::vector<int> ranks, std::vector<std::int64_t> shape);
  // Ranks 0 .. product(shape) - 1 over `shape`.
  static DeviceMesh of_shape(std::vector<std::int64_t> shape);

  std::int64_t ndim() const { return static_cast<std::int64_t>(shape_.size()); }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  // Ranks along mesh dimension `dim` (negative counts from the end).
  std::int64_t size(std::int64_t dim) const;
  std::int64_t numel() const { return static_cast<std::int64_t>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }

  bool contains(int rank) const;
  // The coordinates of `rank`, one per mesh dimension.
  std::vector<std::int64_t> coordinates(int rank) const;
  int rank_at(const std::vector<std::int64_t>& coordinates) const;
  // The ranks that differ from `rank` only along `dim`, in coordinate order: `rank`'s team for a
  // collective over that mesh dimension (Communicator::new_group takes it).
  std::vector<int> team(std::int64_t dim, int rank) const;

  // "DeviceMesh([2, 2], ranks [0, 1, 2, 3])".
  std::string to_string() const;

  friend bool operator==(const DeviceMesh&, const DeviceMesh&) = default;

 private:
  std::int64_t checked_dim(std::int64_t dim) const;

  std::vector<int> ranks_;
  std::vector<std::int64_t> shape_;
};

}  // namespace meshfuse
