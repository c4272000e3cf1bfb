#pragma once
// Communicators: the collectives DataParallel needs, over one device group.
//
// Note [communicators]
// DataParallel talks to its devices only through this interface: broadcast a primary
// buffer to the other devices' buffers, and sum per-device gradients into the primary's.
// CopyCommunicator implements it with copies on the devices' streams (virtual CPU devices,
// and GPU sets that repeat a device, which NCCL refuses); the CUDA backend adds an NCCL
// implementation for sets of distinct GPUs; a multi-process group can implement it later.
#include <memory>
#include <string>
#include <vector>

#include "../core/any_tensor.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

class Communicator {
 public:
  explicit Communicator(std::vector<Stream*> streams) : streams_(std::move(streams)) {
    CHORUS_CHECK(!streams_.empty(), "communicator: no devices");
  }
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// The streams of the group; rank r works on streams()[r]; rank 0 is the root.
  const std::vector<Stream*>& streams() const { return streams_; }
  std::size_t size() const { return streams_.size(); }

  /// dsts[r - 1] (on rank r, r = 1 … dsts.size()) = src (on rank 0); contiguous, equal sizes.
  /// Asynchronous: it is ordered before later work on each destination's stream.
  virtual void broadcast(const AnyTensor& src, const std::vector<AnyTensor>& dsts) = 0;

  /// dsts[j] (on rank 0) = sum over r = 1 … srcs.size() of srcs[r - 1][j] (on rank r).
  /// Synchronous with respect to the calling thread's stream on rank 0.
  virtual void reduce_add(const std::vector<std::vector<AnyTensor>>& srcs, const std::vector<AnyTensor>& dsts) = 0;

  virtual std::string name() const = 0;

 protected:
  std::vector<Stream*> streams_;
};

/// Collectives made of copies: each destination's copy is posted to its stream (so copies to
/// different devices run in parallel), and reductions copy to rank 0 and add there.
class CopyCommunicator final : public Communicator {
 public:
  using Communicator::Communicator;

  void broadcast(const AnyTensor& src, const std::vector<AnyTensor>& dsts) override {
    CHORUS_CHECK(dsts.size() < streams_.size(), "broadcast: ", dsts.size(), " destinations for a group of ",
                 streams_.size());
    for (std::size_t r = 1; r <= dsts.size(); ++r) {
      src.visit([&](const auto& s) {
        using T = typename std::decay_t<decltype(s)>::value_type;
        const auto& d = dsts[r - 1].as<T>();
        CHORUS_CHECK(d.numel() == s.numel(), "broadcast: destination ", r, " has ", d.numel(), " elements, source ",
                     s.numel());
        streams_[r]->post([s, d] { backend::copy(d, s); });
      });
    }
  }

  void reduce_add(const std::vector<std::vector<AnyTensor>>& srcs, const std::vector<AnyTensor>& dsts) override {
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

  std::string name() const override { return "copy"; }
};

}  // namespace parallel
CHORUS_NAMESPACE_END
