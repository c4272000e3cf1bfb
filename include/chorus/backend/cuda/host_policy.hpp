#pragma once
// Host-side decisions of the CUDA backend that need no GPU to make or to test: the alignment
// cuBLASLt may assume for an operand, when the fused bias epilogue is safe, the key under which
// a cuBLASLt plan is cached, which cuDNN algorithms may run under which math type, and checked
// narrowing of sizes to the `int` some CUDA APIs take.
// Plain C++ (no CUDA types), so tests/test_cuda_host.cpp checks it with g++ on any machine.
#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "../../error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {

/// The largest power of two (at most 256, cuBLASLt's default assumption) that divides `address`.
/// Note [cuBLASLt alignment]: without CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES the heuristic
/// assumes 256-byte aligned operands and may pick a kernel that faults ("misaligned address",
/// sticky) or is refused (CUBLAS_STATUS_NOT_SUPPORTED) for a tensor at an element offset, such
/// as a parameter inside DataParallel's flat buffer (Linear(5, 2)'s bias at +40 bytes).
inline std::uint32_t lt_alignment(std::uintptr_t address) {
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a >>= 1;
  return a;
}

/// cuBLASLt's bias epilogue reads the bias with vector loads; a bias that is not 16-byte
/// aligned (or a one-row product, where some versions skip the bias) takes the unfused path.
inline constexpr std::uint32_t kLtBiasAlignment = 16;
inline bool lt_bias_epilogue_ok(std::uintptr_t bias_address, std::int64_t rows) {
  return bias_address % kLtBiasAlignment == 0 && rows > 1;
}

/// What a cached cuBLASLt plan (descriptors and chosen algorithm) depends on
/// (Note [cuBLASLt plan cache] in blas.cuh).
struct LtKey {
  int device = 0;
  std::int64_t m = 0, n = 0, k = 0;
  int dtype = 0;  // DType as int
  bool tf32 = false;
  std::uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0;
  int epilogue = 0;  // 0: none, 1: bias
  bool operator==(const LtKey&) const = default;
};

struct LtKeyHash {
  std::size_t operator()(const LtKey& key) const {
    std::size_t h = 0;
    auto mix = [&h](std::uint64_t v) { h ^= std::hash<std::uint64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(static_cast<std::uint64_t>(key.device));
    mix(static_cast<std::uint64_t>(key.m));
    mix(static_cast<std::uint64_t>(key.n));
    mix(static_cast<std::uint64_t>(key.k));
    mix(static_cast<std::uint64_t>(key.dtype));
    mix(key.tf32);
    mix(key.align_a);
    mix(key.align_b);
    mix(key.align_c);
    mix(key.align_d);
    mix(static_cast<std::uint64_t>(key.epilogue));
    return h;
  }
};

/// cuDNN's math types (cudnnMathType_t, the same values: checked in cudnn.cuh).
enum class ConvMath : int { Default = 0, TensorOp = 1, TensorOpAllowConversion = 2, Fma = 3 };

/// What chorus lets a cuDNN convolution compute with.
struct ConvMathPolicy {
  bool fp32 = true;            // float data (else double or 16-bit: the ranking's own math types)
  bool tf32 = false;           // chorus::cuda::allow_tf32()
  bool deterministic = false;  // cudnn::set_deterministic(true)
};

/// The math type the heuristic query runs under: FMA only for float without TF32 (cuDNN's
/// default math lets Ampere and later use TF32 for float); the default otherwise.
inline ConvMath conv_query_math(const ConvMathPolicy& p) {
  return p.fp32 && !p.tf32 ? ConvMath::Fma : ConvMath::Default;
}

/// One entry of cuDNN's heuristic ranking (cudnnConvolution*AlgoPerf_t, reduced).
struct ConvAlgoPerf {
  int algo = 0;
  bool ok = false;             // status == CUDNN_STATUS_SUCCESS
  ConvMath math = ConvMath::Default;
  bool deterministic = false;  // determinism == CUDNN_DETERMINISTIC
};

/// An entry to try: which one, and the math type to set on the convolution descriptor.
struct ConvAlgoChoice {
  std::size_t index = 0;
  ConvMath math = ConvMath::Default;
};

/// Note [cuDNN algorithm choice]
/// The heuristic's entries that may run, best first, each with the math type it is to run
/// under: the entry's own (cuDNN reports the math type the ranking assumed; the descriptor must
/// be set to it, or the algorithm runs under another one than the one ranked), except that float
/// without TF32 stays on FMA math, and no entry may convert float data to half precision
/// (TENSOR_OP_MATH_ALLOW_CONVERSION: TF32 stops at TENSOR_OP_MATH). Entries that failed, and
/// nondeterministic ones when determinism is asked for, are left out. The caller takes the first
/// whose workspace, asked of cuDNN for that algorithm and math type, fits its limit.
inline std::vector<ConvAlgoChoice> conv_algo_order(const std::vector<ConvAlgoPerf>& perf, const ConvMathPolicy& p) {
  std::vector<ConvAlgoChoice> out;
  for (std::size_t i = 0; i < perf.size(); ++i) {
    const auto& e = perf[i];
    if (!e.ok || (p.deterministic && !e.deterministic)) continue;
    ConvMath m = e.math;
    if (p.fp32 && !p.tf32) m = ConvMath::Fma;
    else if (m == ConvMath::TensorOpAllowConversion) m = ConvMath::TensorOp;
    out.push_back({i, m});
  }
  return out;
}

/// `v` as an int for a CUDA API that takes one; throws naming `what` instead of wrapping.
inline int checked_int(std::int64_t v, const char* what) {
  CHORUS_CHECK(v >= INT_MIN && v <= INT_MAX, what, " = ", v, " does not fit the int that this CUDA call takes");
  return static_cast<int>(v);
}

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
