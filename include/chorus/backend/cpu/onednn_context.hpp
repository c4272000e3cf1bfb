#pragma once
// What chorus's oneDNN calls share (blas_impl.hpp's matmul, onednn_impl.hpp's convolutions): a
// thread's engine and stream, and the lock held while creating a primitive.
#include <mutex>

#include "../../config.hpp"
#include "parallel.hpp"

#if CHORUS_ONEDNN_API
#include <oneapi/dnnl/dnnl.hpp>

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu::onednn {
using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};
/// This thread's oneDNN engine and stream, with its OpenMP team size set (Note [oneDNN threads]).
inline Context& context() {
  thread_local Context c;
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP  // libgomp, which libdnnl links (CMake adds it)
  detail::set_omp_team_size(detail::intra_op_threads());
#endif
  return c;
}

/// Held while creating any oneDNN primitive (Note [oneDNN primitive creation] in onednn.hpp).
inline std::mutex& creation_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace backend::cpu::onednn
CHORUS_NAMESPACE_END
#endif
