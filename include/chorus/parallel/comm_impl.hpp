#pragma once
// The definitions of parallel/comm.hpp (Communicator, CopyCommunicator): compiled into
// chorus::compiled (src/parallel/parallel.cpp), included by comm.hpp itself in the header-only
// form (Note [compiled chorus]).
#include "comm.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

namespace detail {
CHORUS_INLINE AnyTensor host_alias(const AnyTensor& t, Device device) {
  return t.visit([&](const auto& x) { return AnyTensor(host_alias(x, device)); });
}
}  // namespace detail

CHORUS_INLINE Communicator::Communicator(std::vector<Stream*> streams) : streams_(std::move(streams)) {
  CHORUS_CHECK(!streams_.empty(), "communicator: no devices");
}

CHORUS_INLINE std::vector<AnyTensor> Communicator::reduce(std::vector<std::vector<AnyTensor>>&& srcs) {
  CHORUS_CHECK(!srcs.empty(), "reduce: no sources");
  std::vector<AnyTensor> dsts;
  for (const auto& t : srcs[0]) dsts.push_back(empty_any(t.dtype(), t.shape(), streams_[0]->device()));
  reduce_add(srcs, dsts);
  return dsts;
}

CHORUS_INLINE void CopyCommunicator::broadcast(const AnyTensor& src, const std::vector<AnyTensor>& dsts) {
  CHORUS_CHECK(dsts.size() < streams_.size(), "broadcast: ", dsts.size(), " destinations for a group of ",
               streams_.size());
  if (!dsts.empty() && streams_[1]->device().is_cpu()) return broadcast_shared(src, dsts);
  for (std::size_t r = 1; r <= dsts.size(); ++r) {
    if (streams_[r]->device().is_cuda()) {  // after the root's work so far (the optimizer step)
      Event ready;
      ready.record(current_stream(streams_[0]->device()));
      ready.block(*streams_[r]);
    }
    src.visit([&](const auto& s) {
      using T = typename std::decay_t<decltype(s)>::value_type;
      const auto& d = dsts[r - 1].as<T>();
      CHORUS_CHECK(d.numel() == s.numel(), "broadcast: destination ", r, " has ", d.numel(), " elements, source ",
                   s.numel());
      streams_[r]->post([s, d] { backend::copy(d, s); });
    });
  }
}

CHORUS_INLINE void CopyCommunicator::reduce_add(const std::vector<std::vector<AnyTensor>>& srcs,
                                                const std::vector<AnyTensor>& dsts) {
  CHORUS_CHECK(srcs.size() < streams_.size(), "reduce_add: ", srcs.size(), " sources for a group of ",
               streams_.size());
  for (std::size_t j = 0; j < dsts.size(); ++j) {
    dsts[j].visit([&](const auto& d) {
      using T = typename std::decay_t<decltype(d)>::value_type;
      for (std::size_t r = 0; r < srcs.size(); ++r) {
        const auto& s = srcs[r][j].as<T>();
        if (r == 0) {
          backend::copy(d, s);
          continue;
        }
        Tensor<T> tmp = s;
        if (s.device() != d.device() || !s.is_contiguous()) {
          tmp = Tensor<T>::empty(s.shape(), d.device());
          backend::copy(tmp, s);
        }
        backend::binary_same(d, tmp, d, backend::fn::Add{});
      }
    });
  }
}

CHORUS_INLINE std::vector<AnyTensor> CopyCommunicator::reduce(std::vector<std::vector<AnyTensor>>&& srcs) {
  CHORUS_CHECK(!srcs.empty() && srcs.size() < streams_.size(), "reduce: ", srcs.size(), " sources for a group of ",
               streams_.size());
  if (!streams_[0]->device().is_cpu()) return Communicator::reduce(std::move(srcs));
  const Device root = streams_[0]->device();
  std::vector<AnyTensor> out;
  for (std::size_t j = 0; j < srcs[0].size(); ++j) {
    CHORUS_CHECK(srcs[0][j].defined(), "reduce: source tensor ", j, " of rank 1 is undefined");
    const Shape shape = srcs[0][j].shape();
    out.push_back(visit_dtype(srcs[0][j].dtype(), [&](auto tag) {
      using T = decltype(tag);
      std::vector<Tensor<T>> parts;
      for (auto& rank : srcs) {
        CHORUS_CHECK(j < rank.size() && rank[j].defined() && rank[j].dtype() == dtype_of<T>() &&
                         rank[j].shape() == shape,
                     "reduce: sources disagree on tensor ", j);
        Tensor<T> src = std::move(rank[j].template as<T>());
        rank[j] = AnyTensor();  // the view on rank 0 is the only handle now
        parts.push_back(detail::host_view(std::move(src), root));
      }
      Tensor<T> sum = autograd::detail::sum_into_unshared(parts);
      if (!sum.is_contiguous()) sum = sum.contiguous();  // a lone strided source
      return AnyTensor(std::move(sum));
    }));
  }
  return out;
}

CHORUS_INLINE void CopyCommunicator::broadcast_shared(const AnyTensor& src, const std::vector<AnyTensor>& dsts) {
  const std::int64_t n = src.numel();
  const std::int64_t cut = n / static_cast<std::int64_t>(dsts.size() + 1);
  src.visit([&](const auto& s) {
    using T = typename std::decay_t<decltype(s)>::value_type;
    for (std::size_t r = 1; r <= dsts.size(); ++r) {
      const auto& d = dsts[r - 1].as<T>();
      CHORUS_CHECK(d.numel() == n, "broadcast: destination ", r, " has ", d.numel(), " elements, source ", n);
      streams_[r]->synchronize();
      streams_[r]->post([s = s.narrow(0, cut, n - cut), d = d.narrow(0, cut, n - cut)] { backend::copy(d, s); });
    }
    if (cut > 0)
      for (std::size_t r = 1; r <= dsts.size(); ++r) backend::copy(dsts[r - 1].as<T>().narrow(0, 0, cut), s.narrow(0, 0, cut));
  });
}

}  // namespace parallel
CHORUS_NAMESPACE_END
