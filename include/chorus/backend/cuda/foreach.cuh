#pragma once
// CUDA kernels over lists of tensors on one device (compiled only by nvcc): a multi-tensor
// norm (every tensor's blocks in one launch per kTensorsPerLaunch tensors, one partial per
// block, then one block reduces all partials: one result), and in-place scaling / clamping by
// a factor read from device memory, so that clipping never waits on the host (Note [gradient
// clipping on the device], nn/utils.hpp). They mirror backend/cpu/foreach.hpp.
#include <cstdint>
#include <vector>

#include "../../core/tensor.hpp"
#include "../cpu/foreach.hpp"
#include "launch.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {

/// Tensors per launch (their pointers travel in the kernel parameters, well under 4 KB).
inline constexpr int kTensorsPerLaunch = 48;
/// Elements per block of a multi-tensor kernel.
inline constexpr std::int64_t kElemsPerBlock = std::int64_t{kThreads} * 16;

template <class T>
struct TensorChunk {
  T* ptr[kTensorsPerLaunch];
  std::int64_t numel[kTensorsPerLaunch];
  std::int64_t first_block[kTensorsPerLaunch + 1];  // block b belongs to the tensor t with first_block[t] <= b
  int count = 0;
};

/// Splits (ptr, numel) lists into launches of at most kTensorsPerLaunch non-empty tensors.
template <class T>
std::vector<TensorChunk<T>> make_chunks(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels) {
  std::vector<TensorChunk<T>> out;
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    if (numels[i] == 0) continue;
    if (out.empty() || out.back().count == kTensorsPerLaunch) {
      out.emplace_back();
      out.back().first_block[0] = 0;
    }
    auto& c = out.back();
    c.ptr[c.count] = ptrs[i];
    c.numel[c.count] = numels[i];
    c.first_block[c.count + 1] = c.first_block[c.count] + (numels[i] + kElemsPerBlock - 1) / kElemsPerBlock;
    ++c.count;
  }
  return out;
}

namespace k {

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])

/// The tensor of block `b` and the block's element range in it.
template <class T>
__device__ inline int chunk_tensor(const TensorChunk<T>& c, std::int64_t b, std::int64_t& i0, std::int64_t& i1) {
  int t = 0;
  while (t + 1 < c.count && b >= c.first_block[t + 1]) ++t;
  i0 = (b - c.first_block[t]) * kElemsPerBlock;
  const std::int64_t end = i0 + kElemsPerBlock;  // not an unqualified min: which overload it finds depends on the headers
  i1 = c.numel[t] < end ? c.numel[t] : end;
  return t;
}

/// The accumulated norm terms over the block (valid in thread 0).
__device__ inline double block_norm(const NormSpec& s, double v) {
  __shared__ double buf[32];
  for (int o = 16; o > 0; o >>= 1) v = norm_accumulate(s, v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? buf[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v = norm_accumulate(s, v, __shfl_down_sync(0xffffffffu, v, o));
  }
  return v;
}

template <class T>
__global__ void multi_norm(TensorChunk<T> c, NormSpec s, double* partial) {
  std::int64_t i0, i1;
  const int t = chunk_tensor(c, blockIdx.x, i0, i1);
  const T* x = c.ptr[t];
  double acc = 0;
  for (std::int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
    acc = norm_accumulate(s, acc, norm_term(s, static_cast<double>(x[i])));
  acc = block_norm(s, acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

/// One block: accumulates `count` partials into raw[0]; with total/coef, also the norm and
/// clip_grad_norm_'s coefficient. (A template: no external-linkage kernels in headers.)
template <int = 0>
__global__ void finish_norm(const double* partial, std::int64_t count, NormSpec s, double max_norm, double* raw,
                            double* total, double* coef) {
  double acc = 0;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) acc = norm_accumulate(s, acc, partial[i]);
  acc = block_norm(s, acc);
  if (threadIdx.x != 0) return;
  if (raw) raw[0] = acc;
  if (total) {
    const double n = norm_root(s, acc);
    total[0] = n;
    if (coef) coef[0] = clip_coefficient(n, max_norm);
  }
}

template <class T>
__global__ void multi_scale(TensorChunk<T> c, const double* coef) {
  const double f = *coef;
  if (f == 1.0) return;  // multiplying by one changes nothing
  std::int64_t i0, i1;
  T* x = c.ptr[chunk_tensor(c, blockIdx.x, i0, i1)];
  const T m = static_cast<T>(f);
  for (std::int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) x[i] *= m;
}

template <class T>
__global__ void multi_clamp(TensorChunk<T> c, T hi) {
  std::int64_t i0, i1;
  T* x = c.ptr[chunk_tensor(c, blockIdx.x, i0, i1)];
  for (std::int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) x[i] = clamp_abs(x[i], hi);
}

#endif  // __CUDACC__
}  // namespace k

/// raw[0] (device memory) = the accumulated norm terms of every tensor (all on d).
template <class T>
void foreach_norm(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, const NormSpec& s,
                  double* raw, Device d) {
  Launch launch(d);
  const auto chunks = make_chunks(ptrs, numels);
  std::int64_t blocks = 0;
  for (const auto& c : chunks) blocks += c.first_block[c.count];
  auto partial = Tensor<double>::empty(Shape{std::max<std::int64_t>(blocks, 1)}, d);
  std::int64_t at = 0;
  for (const auto& c : chunks) {
    const std::int64_t b = c.first_block[c.count];
    CHORUS_CHECK(b <= INT32_MAX, "foreach_norm: ", b, " blocks in one launch");
    CHORUS_LAUNCH_GRID((k::multi_norm<T>), static_cast<unsigned>(b), kThreads, launch.stream, c, s,
                       partial.data() + at);
    at += b;
  }
  CHORUS_LAUNCH_GRID((k::finish_norm<>), 1, 1024, launch.stream, partial.data(), blocks, s, 0.0, raw, nullptr, nullptr);
}

/// total[0] = the norm of `count` accumulated parts, coef[0] = clip_grad_norm_'s coefficient.
/// (A template, like every launcher, so that chorus::cuda_kernels can compile it once: Note
/// [precompiled CUDA kernels] in instances.hpp.)
template <class Acc>
void norm_finish(const Acc* parts, std::int64_t count, const NormSpec& s, double max_norm, Acc* total, Acc* coef,
                 Device d) {
  static_assert(std::is_same_v<Acc, double>, "norm_finish: the partial norms accumulate in double");
  Launch launch(d);
  CHORUS_LAUNCH_GRID((k::finish_norm<>), 1, 1024, launch.stream, parts, count, s, max_norm, nullptr, total, coef);
}

/// Every tensor *= coef[0] (device memory on d).
template <class T>
void foreach_scale(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, const double* coef,
                   Device d) {
  Launch launch(d);
  for (const auto& c : make_chunks(ptrs, numels)) {
    CHORUS_LAUNCH_GRID((k::multi_scale<T>), static_cast<unsigned>(c.first_block[c.count]), kThreads, launch.stream, c,
                       coef);
  }
}

/// Every element clamped into [-hi, hi].
template <class T>
void foreach_clamp(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, T hi, Device d) {
  Launch launch(d);
  for (const auto& c : make_chunks(ptrs, numels)) {
    CHORUS_LAUNCH_GRID((k::multi_clamp<T>), static_cast<unsigned>(c.first_block[c.count]), kThreads, launch.stream, c,
                       hi);
  }
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_FOREACH_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
