// The machine facts the bench measures against, read from fake sysfs trees.
#include "../measure.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace meshfuse::cli {
namespace {

namespace fs = std::filesystem;

class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("meshfuse_sysfs_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
             "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  void cache(int cpu, int index, int level, const std::string& type, const std::string& size,
             const std::string& shared) {
    const fs::path dir =
        root_ / ("cpu" + std::to_string(cpu)) / "cache" / ("index" + std::to_string(index));
    fs::create_directories(dir);
    std::ofstream(dir / "level") << level << "\n";
    std::ofstream(dir / "type") << type << "\n";
    std::ofstream(dir / "size") << size << "\n";
    std::ofstream(dir / "shared_cpu_list") << shared << "\n";
  }
  // A core of cpu with private L1d, L1i and L2.
  void core(int cpu) {
    const std::string self = std::to_string(cpu);
    cache(cpu, 0, 1, "Data", "32K", self);
    cache(cpu, 1, 1, "Instruction", "32K", self);
    cache(cpu, 2, 2, "Unified", "512K", self);
  }
  fs::path root_;
};

TEST_F(FakeSysfs, TwoCoresSharingOneL3CountItOnce) {
  for (int cpu : {0, 1}) {
    core(cpu);
    cache(cpu, 3, 3, "Unified", "16384K", "0-1");
  }
  EXPECT_EQ(last_level_cache_bytes(root_, {0, 1}), std::int64_t{16} << 20);
}

TEST_F(FakeSysfs, CoresOnTwoL3InstancesAddThemAndOnlyTheAllowedCpusCount) {
  for (int cpu : {0, 1, 2, 3}) {
    core(cpu);
    cache(cpu, 3, 3, "Unified", "32M", cpu < 2 ? "0-1" : "2-3");
  }
  EXPECT_EQ(last_level_cache_bytes(root_, {0, 1, 2, 3}), std::int64_t{64} << 20);
  EXPECT_EQ(last_level_cache_bytes(root_, {2, 3}), std::int64_t{32} << 20);
}

TEST_F(FakeSysfs, WithoutAnL3TheL2IsTheLastLevelAndInstructionCachesAreNot) {
  for (int cpu : {0, 1}) core(cpu);
  cache(0, 3, 4, "Instruction", "8M", "0-1");
  EXPECT_EQ(last_level_cache_bytes(root_, {0, 1}), std::int64_t{1} << 20);
}

TEST_F(FakeSysfs, NoCacheDirectoriesGiveZero) { EXPECT_EQ(last_level_cache_bytes(root_, {0}), 0); }

TEST(LastLevelCache, ThisMachineHasOneWhereSysfsDescribesIt) {
  if (!fs::exists("/sys/devices/system/cpu/cpu0/cache/index0"))
    GTEST_SKIP() << "no cache entries in sysfs";
  EXPECT_GT(last_level_cache_bytes(), 0);
}

}  // namespace
}  // namespace meshfuse::cli
