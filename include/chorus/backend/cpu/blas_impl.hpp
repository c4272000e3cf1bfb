#pragma once
// oneDNN's bfloat16 matmul and the GEMM route's description (backend/cpu/blas.hpp): blas.hpp
// includes this only in the header-only form; src/backend/blas.cpp compiles it into
// chorus::compiled (Note [compiled chorus]).
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "blas.hpp"
#include "onednn_context.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

namespace onednn {
#if CHORUS_GEMM_ONEDNN
/// Whether oneDNN computes bfloat16 with the CPU's own instructions (avx512_bf16 or AMX).
inline bool has_bf16_instructions() {
  static const bool yes = (static_cast<unsigned>(dnnl_get_effective_cpu_isa()) & dnnl_cpu_isa_avx512_core_bf16) ==
                          static_cast<unsigned>(dnnl_cpu_isa_avx512_core_bf16);
  return yes;
}

/// The instruction set oneDNN's kernels use on this CPU.
inline const char* isa_name() {
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_sse41: return "sse4.1";
    default: return "other";
  }
}

/// A product's matmul primitive and its memory layouts (strides carry lda, ldb, ldc).
struct MatmulPlan {
  memory::desc a, b, c;
  dnnl::matmul prim;
};

CHORUS_INLINE bool gemm_bf16(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                             const bfloat16* A, std::int64_t lda, const bfloat16* B, std::int64_t ldb, float beta,
                             bfloat16* C, std::int64_t ldc) {
  if (detail::gemm_route_switch().load(std::memory_order_relaxed) != 0 || !has_bf16_instructions()) return false;
  auto& ctx = context();
  using Key = std::tuple<bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, float, float, int>;
  // Per thread, as the convolution plans (Note [oneDNN convolutions]), and per team size.
  thread_local std::map<Key, std::unique_ptr<MatmulPlan>> cache;
  auto& slot = cache[Key{trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha, beta, detail::intra_op_threads()}];
  if (!slot) {
    const memory::desc a({M, K}, dt::bf16, trans_a ? memory::dims{1, lda} : memory::dims{lda, 1});
    const memory::desc b({K, N}, dt::bf16, trans_b ? memory::dims{1, ldb} : memory::dims{ldb, 1});
    const memory::desc c({M, N}, dt::bf16, memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);  // C is read once, in float, before the result rounds
      attr.set_post_ops(ops);
    }
    std::lock_guard<std::mutex> lock(creation_mutex());  // Note [oneDNN primitive creation]
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, ctx.engine);
    slot = std::make_unique<MatmulPlan>(MatmulPlan{a, b, c, dnnl::matmul(pd)});
  }
  memory am(slot->a, ctx.engine, const_cast<bfloat16*>(A));
  memory bm(slot->b, ctx.engine, const_cast<bfloat16*>(B));
  memory cm(slot->c, ctx.engine, C);
  slot->prim.execute(ctx.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  ctx.stream.wait();
  return true;
}
#endif
}  // namespace onednn

CHORUS_INLINE std::string gemm_route() {
  const std::string openblas = std::string("OpenBLAS (") + openblas_get_corename() + ")";
#if CHORUS_GEMM_ONEDNN
  if (gemm_route_choice() == GemmRoute::automatic) {
    const std::string isa = onednn::isa_name();
    return "float: oneDNN sgemm (" + isa + ") from 32^3, " + openblas + " below; bfloat16: " +
           (onednn::has_bf16_instructions() ? "oneDNN matmul (" + isa + ")" : "widened to float") +
           "; double: " + openblas;
  }
#endif
  return "float: " + openblas + "; bfloat16: widened to float; double: " + openblas;
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
