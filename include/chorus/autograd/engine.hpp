#pragma once
// The backward engine.
//
// Note [multi-device backward]
// backward() walks the graph from the roots, counting for each node how many edges lead to
// it, and runs a node once all of its gradients have arrived. Each node runs on the stream
// its forward ran on (Node::stream()): nodes of the calling thread's own stream (for a plain
// thread, the root's device's current stream) run inline on the calling thread; the others
// are posted to their streams' workers, so the per-replica halves of a DataParallel graph
// run concurrently on their devices. The calling thread coordinates: it waits for posted
// nodes, runs the inline ones as they become ready, and rethrows the first error (naming the
// node and its device) after everything in flight has finished.
#include <optional>
#include <vector>

#include "../backend/backend.hpp"
#include "../compiled.hpp"
#include "node.hpp"

CHORUS_NAMESPACE_BEGIN
namespace autograd {
namespace detail {
/// True when `t` is the only handle to its storage, nothing else sees that storage's memory
/// (for a host alias or a slice: its owner is held by nobody else, storage_unshared), and
/// `t` covers all of it: it may be written in place or kept as a gradient unseen.
template <class T>
bool exclusively_owned(const Tensor<T>& t) {
  const auto& st = t.impl()->storage;
  return t.impl().use_count() == 1 && storage_unshared(st) && t.is_contiguous() && t.storage_offset() == 0 &&
         st->nbytes() == static_cast<std::size_t>(t.numel()) * sizeof(T);
}

/// The sum of gradients for one input, all on one device (undefined when there are none):
/// written into a part that nothing else sees (exclusively_owned) when there is one, else
/// into new memory; a single part is returned as it is. Shared by the engine (gradients
/// that meet at one input) and the CPU communicator (a bucket's replica gradients, viewed
/// on the primary device through host aliases), so that both follow one rule about which
/// memory may be written.
/// `memory_of`: prefer a part whose memory that device allocated (a gradient kept there,
/// DataParallel::shard_gradients: it is then handed over without a copy).
template <class T>
Tensor<T> sum_into_unshared(std::vector<Tensor<T>>& parts, std::optional<Device> memory_of = std::nullopt) {
  if (parts.empty()) return {};
  if (parts.size() == 1) return std::move(parts[0]);
  auto contiguous = [](const Tensor<T>& t) {
    if (t.is_contiguous()) return t;
    auto c = Tensor<T>::empty(t.shape(), t.device());
    backend::copy(c, t);
    return c;
  };
  for (std::size_t i = 1; i < parts.size(); ++i)
    CHORUS_CHECK(parts[i].device() == parts[0].device(), "autograd: gradients for one input arrived on ",
                 parts[0].device(), " and ", parts[i].device());
  // The parts are added left to right (Note [gradients add in graph order]): a part's memory
  // takes the sum only if it is the first or second, whose sum comes first anyway.
  std::size_t into = parts.size();
  for (std::size_t i = 0; i < std::min<std::size_t>(parts.size(), 2) && into == parts.size(); ++i)
    if (exclusively_owned(parts[i])) into = i;
  if (into == 0 && memory_of && exclusively_owned(parts[1]) && memory_device(parts[1].impl()->storage) == *memory_of)
    into = 1;  // a + b is b + a: the same sum in the other part's memory
  Tensor<T> sum;
  if (into < parts.size()) {
    sum = std::move(parts[into]);
  } else {
    sum = Tensor<T>::empty(parts[0].shape(), parts[0].device());
    backend::copy(sum, parts[0]);
    into = 0;
  }
  for (std::size_t i = 0; i < parts.size(); ++i)
    if (i != into) backend::binary_same(sum, contiguous(parts[i]), sum, backend::fn::Add{});
  return sum;
}

}  // namespace detail

namespace detail {
template <class T>
std::vector<Tensor<T>> gradients_in(const NodeBase& node, std::vector<std::vector<AnyTensor>>&& arrived) {
  std::vector<Tensor<T>> inputs(node.num_inputs());
  for (std::size_t i = 0; i < arrived.size() && i < inputs.size(); ++i) {
    std::vector<Tensor<T>> parts;
    parts.reserve(arrived[i].size());
    for (auto& a : arrived[i]) parts.push_back(std::move(a.as<T>()));
    inputs[i] = sum_into_unshared(parts, node.gradient_memory());
  }
  for (std::uint32_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      const auto& meta = node.input_meta(i);
      inputs[i] = Tensor<T>::empty(meta.shape, meta.device);
      backend::fill(inputs[i], T(0));
    } else if (!inputs[i].is_contiguous()) {
      auto c = Tensor<T>::empty(inputs[i].shape(), inputs[i].device());
      backend::copy(c, inputs[i]);
      inputs[i] = std::move(c);
    }
  }
  return inputs;
}

/// Runs backward from `roots` (each seeded with its gradient in `seeds`, of its node's dtype) as
/// far as `stops`, whose nodes do not run, and returns the gradient that reached each stop edge
/// (undefined where none did): torch.autograd.grad with the stops as its inputs. Nodes of the
/// stream `home` run on the calling thread. Checkpoint's recomputation runs its graph this way
/// (Note [activation checkpointing] in autograd/checkpoint.hpp).
CHORUS_INLINE std::vector<AnyTensor> grad_at(const std::vector<Edge>& roots, std::vector<AnyTensor> seeds,
                                             const std::vector<Edge>& stops, Stream* home);
}  // namespace detail

/// Runs backward from `roots` (seeded with `grads`; an undefined seed means ones for a
/// one-element root), accumulating into the leaves' grad(). See Note [multi-device backward].
template <class T>
void backward(const std::vector<Tensor<T>>& roots, const std::vector<Tensor<T>>& grads = {},
              bool retain_graph = false);

}  // namespace autograd

template <class T>
void Tensor<T>::backward(const Tensor<T>& gradient, bool retain_graph) const {
  autograd::backward<T>({*this}, {gradient}, retain_graph);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_AUTOGRAD_ENGINE_FLOAT_INSTANCES(X, T)                                             \
  X(void autograd::backward<T>(const std::vector<Tensor<T>>&, const std::vector<Tensor<T>>&, bool))
CHORUS_EXTERN_INSTANCES(CHORUS_AUTOGRAD_ENGINE_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
// Every dtype: operations over integer tensors name grad_accumulator<T> (never reached at run time).
#define CHORUS_AUTOGRAD_ACCUMULATE_INSTANCES(X, T) X(class autograd::AccumulateGrad<T>)
CHORUS_EXTERN_INSTANCES(CHORUS_AUTOGRAD_ACCUMULATE_INSTANCES, CHORUS_ALL_DTYPES)

#if !CHORUS_COMPILED
#include "engine_impl.hpp"
#endif
