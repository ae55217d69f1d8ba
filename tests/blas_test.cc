// blas_test.cc: the BLAS kernel check (blas.h) and gpipe's environment variables (environment.h).
#include <gpipe/blas.h>
#include <gpipe/environment.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using gpipe::BlasKernel;
using gpipe::best_blas_kernel;

// /proc/cpuinfo's flags of a few CPUs, the part that decides.
const std::vector<std::string> kSapphireRapids = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512cd",
                                                  "avx512bw", "avx512vl", "avx512_bf16", "amx_tile"};
const std::vector<std::string> kSkylakeServer = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512cd",
                                                 "avx512bw", "avx512vl"};
const std::vector<std::string> kZen3 = {"sse2", "avx", "avx2", "fma", "bmi2"};
const std::vector<std::string> kXeonPhi = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512er"};
const std::vector<std::string> kSandyBridge = {"sse2", "sse4_2", "avx"};
const std::vector<std::string> kCore2 = {"sse2", "ssse3"};

TEST(BlasKernel, BestForTheFeaturesOfACpu) {
  EXPECT_EQ(best_blas_kernel(kSapphireRapids), "Cooperlake");
  EXPECT_EQ(best_blas_kernel(kSkylakeServer), "SkylakeX");
  EXPECT_EQ(best_blas_kernel(kZen3), "Haswell");
  EXPECT_EQ(best_blas_kernel(kXeonPhi), "Haswell");  // AVX-512 without BW, DQ and VL: not SkylakeX's
  EXPECT_EQ(best_blas_kernel(kSandyBridge), "Sandybridge");
  EXPECT_EQ(best_blas_kernel(kCore2), "");
  EXPECT_EQ(best_blas_kernel({}), "");
}

TEST(BlasKernel, GenericOnlyWithoutAvxOnACpuWithAvx2OrMore) {
  EXPECT_TRUE(gpipe::blas_kernel_without_avx("Prescott"));
  EXPECT_TRUE(gpipe::blas_kernel_without_avx("PRESCOTT"));  // OpenBLAS takes names in any case
  EXPECT_TRUE(gpipe::blas_kernel_without_avx("Nehalem"));
  EXPECT_FALSE(gpipe::blas_kernel_without_avx("Haswell"));
  EXPECT_FALSE(gpipe::blas_kernel_without_avx("Zen"));
  EXPECT_FALSE(gpipe::blas_kernel_without_avx(""));

  BlasKernel kernel{"Prescott", "Cooperlake", "", "AVX-512", "OpenBLAS"};
  EXPECT_TRUE(kernel.generic());
  const std::string advice = kernel.advice();
  EXPECT_NE(advice.find("generic Prescott kernel"), std::string::npos) << advice;
  EXPECT_NE(advice.find("has AVX-512"), std::string::npos) << advice;
  EXPECT_NE(advice.find("Export OPENBLAS_CORETYPE=Cooperlake before"), std::string::npos) << advice;
  EXPECT_NE(advice.find("GPIPE_BLAS_CORETYPE=keep"), std::string::npos) << advice;

  kernel.running = "SkylakeX";  // a kernel with AVX-512: right, if not the newest
  EXPECT_FALSE(kernel.generic());
  EXPECT_EQ(kernel.advice(), "");
  BlasKernel old_cpu{"Prescott", "Sandybridge", "", "AVX", "OpenBLAS"};  // an AVX-only CPU: left alone
  EXPECT_FALSE(old_cpu.generic());
  BlasKernel not_openblas{"", "Haswell", "", "AVX2", "OpenBLAS"};
  EXPECT_FALSE(not_openblas.generic());
}

TEST(BlasKernel, EveryKindOfKernelHasANameOpenBlasTakes) {
  const auto& names = gpipe::blas_kernel_names();
  for (const char* name : {"Prescott", "Sandybridge", "Haswell", "SkylakeX", "Cooperlake", "Zen"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
}

TEST(BlasKernel, ThisProcess) {
  const BlasKernel kernel = gpipe::blas_kernel();
  ASSERT_FALSE(kernel.running.empty()) << "the tests run with OpenBLAS (scripts/install-deps.sh installs it)";
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  EXPECT_EQ(kernel.coretype, coretype == nullptr ? "" : coretype);
  EXPECT_EQ(kernel.chosen_by, kernel.coretype.empty() ? "OpenBLAS" : "OPENBLAS_CORETYPE");
  EXPECT_TRUE(gpipe::blas_products_right());
  EXPECT_GT(gpipe::blas_gflops(), 0.1);
}

TEST(Environment, EmptyIsUnsetAndAnUnknownValueIsRefusedNamingTheChoices) {
  const char* name = "GPIPE_TEST_ENVIRONMENT_CHOICE";
  unsetenv(name);
  EXPECT_EQ(gpipe::environment_value(name), "");
  EXPECT_EQ(gpipe::environment_choice(name, {"on", "off"}, "what it does"), "");
  setenv(name, "", 1);
  EXPECT_EQ(gpipe::environment_choice(name, {"on", "off"}, "what it does"), "");
  setenv(name, "off", 1);
  EXPECT_EQ(gpipe::environment_choice(name, {"on", "off"}, "what it does"), "off");
  setenv(name, "yes", 1);
  try {
    gpipe::environment_choice(name, {"on", "off"}, "what it does");
    ADD_FAILURE() << "yes was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "gpipe: GPIPE_TEST_ENVIRONMENT_CHOICE=yes is not one of on, off (what it does); unset it "
                           "or give one of them");
  }
  unsetenv(name);
}

TEST(Environment, ABlasSettingGpipeDoesNotTakeIsRefusedAndAKernelIsNamedInAnyCase) {
  const std::string before = gpipe::environment_value("GPIPE_BLAS_CORETYPE");  // ctest's keep
  setenv("GPIPE_BLAS_CORETYPE", "fastest", 1);
  EXPECT_THROW(gpipe::blas_warning(), std::invalid_argument);
  setenv("GPIPE_BLAS_CORETYPE", "haswell", 1);
  EXPECT_NO_THROW(gpipe::blas_warning());
  setenv("GPIPE_BLAS_CORETYPE", "keep", 1);
  EXPECT_EQ(gpipe::blas_warning(), "");
  setenv("GPIPE_BLAS_CORETYPE", before.c_str(), 1);
}

}  // namespace
