// The CPU's routes: every matrix-product route against a float64 reference (Note [which GEMM]),
// and chorus's own loops giving the same bits at every vector width the CPU has (Note [CPU
// capability]).
#include <gtest/gtest.h>

#include <bit>
#include <chorus/chorus.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
using namespace chorus;
namespace cpu = chorus::backend::cpu;

/// Restores the process-wide route and capability a test changes.
struct RestoreRoutes {
  cpu::GemmRoute route = cpu::gemm_route_choice();
  cpu::CpuCapability cap = cpu::get_cpu_capability();
  ~RestoreRoutes() {
    cpu::set_gemm_route(route);
    cpu::set_cpu_capability(cap);
  }
};

struct Product {
  std::int64_t M, N, K;
};

/// One product through backend::cpu::gemm<T>, with every operand padded (ld = columns + 3) and
/// C's padding checked untouched, against the float64 product of the same (rounded) values:
/// |C - exact| <= rounding + K·2^-23·(|alpha|·|A||B| + |beta·C0|), the bound of a float sum of K
/// terms in any order (Higham, Accuracy and Stability of Numerical Algorithms, §3.5) plus the
/// final rounding to T (2^-24 for float, 2^-8 for bfloat16).
template <class T>
::testing::AssertionResult check_product(const Product& p, bool ta, bool tb, float alpha, float beta,
                                         std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const std::int64_t ar = ta ? p.K : p.M, ac = ta ? p.M : p.K, br = tb ? p.N : p.K, bc = tb ? p.K : p.N;
  const std::int64_t lda = ac + 3, ldb = bc + 3, ldc = p.N + 3;
  std::vector<T> A(static_cast<std::size_t>(ar * lda)), B(static_cast<std::size_t>(br * ldb)),
      C(static_cast<std::size_t>(p.M * ldc));
  for (auto& v : A) v = T(dist(gen));
  for (auto& v : B) v = T(dist(gen));
  for (auto& v : C) v = T(dist(gen));
  const std::vector<T> C0 = C;
  cpu::gemm<T>(ta, tb, p.M, p.N, p.K, T(alpha), A.data(), lda, B.data(), ldb, T(beta), C.data(), ldc);
  const double final_rounding = std::is_same_v<T, float> ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
  for (std::int64_t i = 0; i < p.M; ++i) {
    for (std::int64_t j = 0; j < p.N; ++j) {
      double exact = 0, magnitude = 0;
      for (std::int64_t k = 0; k < p.K; ++k) {
        const double a = static_cast<double>(ta ? A[k * lda + i] : A[i * lda + k]);
        const double b = static_cast<double>(tb ? B[j * ldb + k] : B[k * ldb + j]);
        exact += a * b;
        magnitude += std::fabs(a * b);
      }
      const double c0 = static_cast<double>(C0[i * ldc + j]);
      exact = double(alpha) * exact + (beta == 0.0f ? 0.0 : double(beta) * c0);
      const double bound = final_rounding * std::fabs(exact) +
                           double(p.K + 2) * std::ldexp(1.0, -23) *
                               (std::fabs(double(alpha)) * magnitude + std::fabs(double(beta) * c0)) +
                           1e-30;
      const double got = static_cast<double>(C[i * ldc + j]);
      if (!(std::fabs(got - exact) <= bound))
        return ::testing::AssertionFailure()
               << p.M << "x" << p.N << "x" << p.K << " ta=" << ta << " tb=" << tb << " alpha=" << alpha
               << " beta=" << beta << ": C[" << i << "," << j << "] = " << got << ", exact " << exact << " (bound "
               << bound << ")";
    }
    for (std::int64_t j = p.N; j < ldc; ++j)
      if (std::memcmp(&C[i * ldc + j], &C0[i * ldc + j], sizeof(T)) != 0)
        return ::testing::AssertionFailure() << "the padding of C changed at row " << i;
  }
  return ::testing::AssertionSuccess();
}

// Below, at and above the size where float products move from OpenBLAS to oneDNN (32^3), and
// the tutorial's Linear(5, 2) on 30 rows.
const std::vector<Product> kProducts = {{30, 2, 5}, {1, 1, 1}, {31, 31, 31}, {32, 32, 32}, {67, 45, 129}, {200, 300, 150}};

template <class T>
void check_every_product(cpu::GemmRoute route) {
  RestoreRoutes restore;
  cpu::set_gemm_route(route);
  std::uint32_t seed = 1;
  for (const auto& p : kProducts)
    for (int t = 0; t < 4; ++t) {
      for (const auto& [alpha, beta] : std::vector<std::pair<float, float>>{{1.0f, 0.0f}, {0.5f, 1.0f}, {1.0f, -0.25f}}) {
        EXPECT_TRUE(check_product<T>(p, t & 1, t & 2, alpha, beta, seed++));
      }
    }
}

TEST(GemmRoutes, FloatProductsMatchAFloat64ReferenceOnEveryRoute) {
  check_every_product<float>(cpu::GemmRoute::automatic);
  check_every_product<float>(cpu::GemmRoute::openblas);
}

TEST(GemmRoutes, BFloat16ProductsMatchAFloat64ReferenceOnEveryRoute) {
  check_every_product<bfloat16>(cpu::GemmRoute::automatic);
  check_every_product<bfloat16>(cpu::GemmRoute::openblas);
}

TEST(GemmRoutes, LargeFloatProductsLeaveOpenBlasWhereChorusHasOneDnn) {
  RestoreRoutes restore;
  const Product p{200, 300, 150};
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> A(p.M * p.K), B(p.K * p.N), C1(p.M * p.N), C2(p.M * p.N);
  for (auto& v : A) v = dist(gen);
  for (auto& v : B) v = dist(gen);
  cpu::set_gemm_route(cpu::GemmRoute::automatic);
  cpu::gemm<float>(false, false, p.M, p.N, p.K, 1.0f, A.data(), p.K, B.data(), p.N, 0.0f, C1.data(), p.N);
  const std::string automatic = cpu::gemm_route();
  cpu::set_gemm_route(cpu::GemmRoute::openblas);
  cpu::gemm<float>(false, false, p.M, p.N, p.K, 1.0f, A.data(), p.K, B.data(), p.N, 0.0f, C2.data(), p.N);
  const std::string openblas = cpu::gemm_route();
  EXPECT_EQ(openblas.find("oneDNN"), std::string::npos) << openblas;
#if CHORUS_GEMM_ONEDNN
  // Another kernel ran: a sum of 150 products in another order differs somewhere.
  EXPECT_NE(C1, C2);
  EXPECT_EQ(automatic.rfind("float: oneDNN sgemm", 0), 0u) << automatic;
  EXPECT_EQ(automatic.find("bfloat16: oneDNN matmul") != std::string::npos,
            (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16)
      << automatic;
#else
  EXPECT_EQ(C1, C2);
  EXPECT_EQ(automatic, openblas);
#endif
}

/// Bits of every value a small float training step computes: the unary functions, broadcasting,
/// softmax over either axis, layer norm, an LSTM, cross entropy, sums, and Adam's and SGD's
/// updates (with their gradients). Odd sizes leave tails after every vector width.
std::vector<std::uint32_t> step_bits() {
  manual_seed(11);
  std::vector<std::uint32_t> bits;
  auto keep = [&](const Tensor<float>& t) {
    for (float v : t.contiguous().to_vector()) bits.push_back(std::bit_cast<std::uint32_t>(v));
  };
  auto x = (randn<float>({7, 33, 41}) * 4.0f).requires_grad_(true);
  auto w = randn<float>({41}).requires_grad_(true), b = randn<float>({41}).requires_grad_(true);
  auto col = randn<float>({7, 1, 41});
  nn::LSTM lstm(41, 23);
  auto ys = exp(x * 0.1f) + tanh(x) + sigmoid(x) * col;
  auto ln = layer_norm(ys, {41}, w, b);
  auto sm = softmax(ln, 2) + log_softmax(ln, 1);
  auto [out, state] = lstm->forward(sm);
  auto logits = out.reshape({7 * 33, 23});
  auto target = randint<std::int64_t>(0, 23, {7 * 33});
  auto loss = nn::functional::cross_entropy(logits, target) + sum(sm.sum(1)) * 1e-3f + (x - ys).pow(2).mean();
  loss.backward();
  for (const auto& t : std::vector<Tensor<float>>{ys, ln, sm, out, loss}) keep(t);
  std::vector<Tensor<float>> params = {x, w, b};
  for (auto& p : lstm->parameters()) params.push_back(p.as<float>());
  for (auto& p : params) keep(p.grad());
  optim::Adam adam({params.begin(), params.begin() + 3}, optim::AdamOptions{.lr = 1e-2});
  optim::SGD sgd({params.begin() + 3, params.end()}, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  for (int i = 0; i < 2; ++i) {
    adam.step();
    sgd.step();
  }
  for (auto& p : params) keep(p.detach());
  return bits;
}

TEST(CpuCapability, EveryCapabilityOfThisCpuGivesTheSameBits) {
  RestoreRoutes restore;
  const auto best = cpu::detail::cpu_capability_supported();
#if CHORUS_CPU_DISPATCH
  // By default chorus uses the best copy this CPU runs.
  EXPECT_EQ(cpu::get_cpu_capability(), std::getenv("CHORUS_CPU_CAPABILITY") ? cpu::get_cpu_capability() : best);
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    EXPECT_EQ(best, cpu::CpuCapability::avx512);
  }
#endif
  if (best != cpu::CpuCapability::avx512) {
    EXPECT_THROW(cpu::set_cpu_capability(cpu::CpuCapability::avx512), Error);
  }
  cpu::set_cpu_capability(cpu::CpuCapability::baseline);
  const auto reference = step_bits();
  ASSERT_GT(reference.size(), 10000u);
  for (int c = 1; c <= static_cast<int>(best); ++c) {
    cpu::set_cpu_capability(static_cast<cpu::CpuCapability>(c));
    const auto got = step_bits();
    ASSERT_EQ(got.size(), reference.size());
    std::size_t differ = 0, first = got.size();
    for (std::size_t i = 0; i < got.size(); ++i)
      if (got[i] != reference[i]) {
        ++differ;
        first = std::min(first, i);
      }
    EXPECT_EQ(differ, 0u) << cpu::cpu_capability_name(static_cast<cpu::CpuCapability>(c)) << ": " << differ
                          << " values differ from the baseline's, the first at " << first;
  }
}

TEST(CpuRoutes, TheEnvironmentsChoicesAreCheckedByName) {
  EXPECT_EQ(cpu::detail::parse_gemm_route("openblas"), cpu::GemmRoute::openblas);
  EXPECT_EQ(cpu::detail::parse_gemm_route("auto"), cpu::GemmRoute::automatic);
  EXPECT_THROW(cpu::detail::parse_gemm_route("OpenBLAS "), Error);
  EXPECT_EQ(cpu::detail::parse_cpu_capability("default"), cpu::CpuCapability::baseline);
  EXPECT_EQ(cpu::detail::parse_cpu_capability("avx2"), cpu::CpuCapability::avx2);
  EXPECT_EQ(cpu::detail::parse_cpu_capability("avx512"), cpu::CpuCapability::avx512);
  try {
    cpu::detail::parse_cpu_capability("sse2");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CHORUS_CPU_CAPABILITY=sse2: expected default, avx2 or avx512"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
