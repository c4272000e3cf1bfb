#pragma once
// Activation checkpointing in the graph: one node stands for a function whose activations are
// dropped after forward and recomputed in backward (nn::utils::checkpoint and nn::Checkpoint,
// in nn/checkpoint.hpp, are what users call).
//
// Note [activation checkpointing]
// chorus's nodes keep what they save in their own members (there are no saved-tensor hooks to
// intercept), so a checkpointed function becomes one node of the graph, as PyTorch's
// non-reentrant checkpoint behaves (torch.utils.checkpoint, use_reentrant=False):
// - Forward runs the function with grad mode on, on detached copies of its tensor inputs,
//   while an EdgeLog (autograd/node.hpp) notes each edge its operations take to a node made
//   before it began or to a leaf's accumulator, with the tensor it came from: the parameters it
//   uses (their accumulators, DDP's ParamReady nodes, a DataParallel replica's broadcast) and
//   anything else it captured. One CheckpointBackward node then takes the history of the
//   outputs, with an edge to each input and to each of those boundary edges, and the function's
//   own graph, with every activation it saved, is freed when forward returns. The node keeps the
//   inputs, the function and the tape of its random draws (Note [checkpoint random numbers] in
//   core/generator.hpp).
// - Backward runs the node once, after every gradient of its outputs arrived. It runs the
//   function again on fresh detached inputs, grad mode on, on the node's thread and stream,
//   replaying the tape; then runs the new graph backward (detail::grad_at) up to the new inputs
//   and the boundary edges, which do not run there, and hands the gradients that reached them on
//   as its own. A parameter thus gets its gradient once, from this node, as it would from the
//   plain graph: DDP's buckets and DataParallel's reductions see it ready once (PyTorch's
//   reentrant checkpoint broke that: "Expected to mark a variable ready only once"). The
//   recomputation's boundary edges are matched to forward's by their tensors' identity: an edge
//   may lead elsewhere by then (DDP's ParamReady nodes exist only during forward).
// - The recomputation repeats forward's operations on the same values in the same order, so on
//   the CPU the gradients equal the plain run's bit for bit. (Where a tensor's gradient has three
//   or more parts, some from inside the function and some from outside, the parts may be added
//   in another order.)
// - What must happen once per forward is skipped while recomputing (autograd::is_recomputing():
//   batch norm's running statistics), and what cannot happen again alike is refused inside a
//   checkpointed function: host random numbers, and SyncBatchNorm in training (its
//   recomputation would meet the other replicas at another time).
// A checkpointed function may hold another: forward's edge log and tape reach the outer one.
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/generator.hpp"
#include "engine.hpp"

CHORUS_NAMESPACE_BEGIN
namespace autograd {

/// A checkpointed function as the graph keeps it: maps its tensor inputs that require grad (in
/// argument order; detached copies when it is recomputed) to its outputs.
template <class T>
using CheckpointFn = std::function<std::vector<Tensor<T>>(const std::vector<AnyTensor>& inputs)>;

namespace detail {

/// While alive, the calling thread runs a checkpointed function, once in forward or again in
/// backward: the edges it takes out are logged and its random draws taped (recorded or
/// replayed). finish() ends it early and hands over the log.
class CheckpointScope {
 public:
  CheckpointScope(::chorus::detail::PhiloxTape& tape, bool recompute)
      : prev_log_(current_edge_log()),
        prev_tape_(::chorus::detail::current_philox_tape()),
        prev_phase_(checkpoint_phase()) {
    log_.start = next_sequence_nr();
    tape.parent = prev_tape_;
    tape.replaying = recompute;
    tape.next = 0;
    if (!recompute) tape.draws.clear();
    current_edge_log() = &log_;
    ::chorus::detail::current_philox_tape() = &tape;
    checkpoint_phase() = recompute || prev_phase_ == 2 ? 2 : 1;
  }
  ~CheckpointScope() { restore(); }
  CheckpointScope(const CheckpointScope&) = delete;
  CheckpointScope& operator=(const CheckpointScope&) = delete;

  EdgeLog& finish() {
    restore();
    return log_;
  }

 private:
  void restore() {
    if (done_) return;
    done_ = true;
    current_edge_log() = prev_log_;
    ::chorus::detail::current_philox_tape() = prev_tape_;
    checkpoint_phase() = prev_phase_;
  }
  EdgeLog log_;
  EdgeLog* prev_log_;
  ::chorus::detail::PhiloxTape* prev_tape_;
  int prev_phase_;
  bool done_ = false;
};

/// Detached copies of `inputs` that require grad: the leaves a checkpointed function runs on.
inline std::vector<AnyTensor> checkpoint_leaves(const std::vector<AnyTensor>& inputs) {
  std::vector<AnyTensor> out;
  out.reserve(inputs.size());
  for (const auto& in : inputs)
    in.visit([&](const auto& t) {
      auto leaf = t.detach();
      if constexpr (is_floating_v<typename std::decay_t<decltype(t)>::value_type>) leaf.requires_grad_(true);
      out.emplace_back(std::move(leaf));
    });
  return out;
}

/// The edges of `log` that are not one of `leaves`.
inline std::vector<EdgeLog::Entry> edges_out(EdgeLog& log, const std::vector<AnyTensor>& leaves) {
  std::vector<EdgeLog::Entry> out;
  for (auto& e : log.entries) {
    bool leaf = false;
    for (const auto& l : leaves) leaf = leaf || l.impl_key() == e.tensor.impl_key();
    if (!leaf) out.push_back(std::move(e));
  }
  return out;
}

/// The version of `t`'s storage (Note [version counter]; 0 for none).
inline std::uint64_t storage_version(const AnyTensor& t) {
  return t.visit([](const auto& x) -> std::uint64_t {
    return x.defined() && x.impl()->storage ? x.impl()->storage->version() : 0;
  });
}

/// Throws, in the engine's words, when a tensor a checkpointed function reads changed in place
/// between its forward and its recomputation.
inline void check_checkpoint_version(std::uint64_t then, std::uint64_t now, const Shape& shape, DType dtype) {
  CHORUS_CHECK(now == then,
               "one of the variables needed for gradient computation has been modified by an inplace operation: [",
               dtype_name(dtype), " ", shape, "], read by a checkpointed function, is at version ", now,
               "; expected version ", then,
               " instead. Write into a copy (clone()) of a tensor that a checkpointed function reads, or run "
               "backward before changing it");
}

/// The sum of two gradients for one edge (either may be undefined).
inline AnyTensor add_gradients(AnyTensor a, AnyTensor b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return visit_dtype(a.dtype(), [&](auto tag) -> AnyTensor {
    using U = decltype(tag);
    if constexpr (is_floating_v<U>) {
      std::vector<Tensor<U>> parts{std::move(a.template as<U>()), std::move(b.template as<U>())};
      return sum_into_unshared(parts);
    } else {
      CHORUS_FAIL("checkpoint: a ", dtype_name(a.dtype()), " gradient");
    }
  });
}

}  // namespace detail

/// The node of a checkpointed function (Note [activation checkpointing]): next edges are the
/// function's tensor inputs, then the edges out of it that forward took.
template <class T>
class CheckpointBackward final : public NodeBase {
 public:
  /// The node's name, "CheckpointBackward".
  std::string name() const override { return "CheckpointBackward"; }
  DType dtype() const override { return dtype_of<T>(); }
  void release_saved() override {
    fn_ = nullptr;
    inputs_.clear();
    read_.clear();
    edge_of_.clear();
    tape_.draws.clear();
  }

  std::vector<AnyTensor> apply_any(std::vector<std::vector<AnyTensor>>&& arrived) override {
    for (const auto& c : read_)
      detail::check_checkpoint_version(c.version, detail::storage_version(c.tensor), c.tensor.shape(),
                                       c.tensor.dtype());
    auto grads = detail::gradients_in<T>(*this, std::move(arrived));
    GradModeGuard grad_on(true);
    ReplicaGuard replica(this->replica());
    Stream& home = stream() ? *stream() : current_stream(device());
    StreamGuard on_home(home);
    std::vector<AnyTensor> leaves;
    std::vector<Tensor<T>> outs;
    std::vector<Edge> roots;
    std::vector<detail::EdgeLog::Entry> out_edges;
    {
      detail::CheckpointScope scope(tape_, /*recompute=*/true);
      leaves = detail::checkpoint_leaves(inputs_);
      outs = fn_(leaves);
      CHORUS_CHECK(outs.size() == num_outputs_, "checkpoint: the recomputed function returned ", outs.size(),
                   " tensors; its forward returned ", num_outputs_);
      for (std::size_t i = 0; i < outputs_.size(); ++i) {
        const auto& o = outs[outputs_[i]];
        const Shape& then = input_meta(static_cast<std::uint32_t>(i)).shape;
        CHORUS_CHECK(o.defined() && o.shape() == then, "checkpoint: output ", outputs_[i],
                     " of the recomputed function is ", o.defined() ? "of shape " : "undefined",
                     o.defined() ? o.shape() : Shape{}, "; in forward it was of shape ", then);
        roots.push_back(gradient_edge(o));
      }
      out_edges = detail::edges_out(scope.finish(), leaves);
      CHORUS_CHECK(tape_.next == tape_.draws.size(), "checkpoint: recomputing the checkpointed function drew ",
                   tape_.next, " times from a random generator; its forward drew ", tape_.draws.size(),
                   " times: it must run the same operations each time");
    }
    // Stops: the new leaves' accumulators (this node's first edges), then the edges out, matched
    // to forward's by their tensors.
    std::vector<Edge> stops;
    std::vector<std::size_t> to;
    for (std::size_t j = 0; j < leaves.size(); ++j)
      leaves[j].visit([&](const auto& leaf) {
        if constexpr (is_floating_v<typename std::decay_t<decltype(leaf)>::value_type>) {
          stops.push_back({grad_accumulator(leaf), 0});
          to.push_back(j);
        }
      });
    for (const auto& e : out_edges) {
      const auto it = edge_of_.find(e.tensor.impl_key());
      CHORUS_CHECK(it != edge_of_.end(), "checkpoint: the recomputed function used a tensor that requires grad (",
                   e.edge.fn->name(), "), which its forward did not: it must run the same operations on the same "
                   "tensors each time");
      const AnyTensor& then = it->second.tensor;
      detail::check_checkpoint_version(it->second.version, e.version, then.shape(), then.dtype());
      bool seen = false;
      for (const auto& s : stops) seen = seen || (s.fn == e.edge.fn && s.input_nr == e.edge.input_nr);
      if (seen) continue;
      stops.push_back(e.edge);
      to.push_back(it->second.edge);
    }
    std::vector<Edge> live_roots;
    std::vector<AnyTensor> seeds;
    for (std::size_t i = 0; i < roots.size(); ++i) {
      if (!roots[i].valid()) continue;
      live_roots.push_back(roots[i]);
      seeds.emplace_back(std::move(grads[i]));
    }
    auto got = detail::grad_at(live_roots, std::move(seeds), stops, &home);
    std::vector<AnyTensor> result(next_edges().size());
    for (std::size_t k = 0; k < stops.size(); ++k)
      result[to[k]] = detail::add_gradients(std::move(result[to[k]]), std::move(got[k]));
    return result;
  }

 private:
  template <class U>
  friend std::vector<Tensor<U>> checkpoint(CheckpointFn<U> fn, std::vector<AnyTensor> inputs,
                                           std::vector<AnyTensor> reads);

  struct Read {  // a tensor the function reads, and its version in forward
    AnyTensor tensor;
    std::uint64_t version;
  };
  struct Out {  // a tensor forward took an edge out from (its identity is the key)
    AnyTensor tensor;
    std::uint64_t version;
    std::size_t edge;  // its next edge
  };
  CheckpointFn<T> fn_;
  std::vector<AnyTensor> inputs_;  // the function's tensor inputs that require grad
  std::vector<Read> read_;         // those and its other tensor arguments
  std::unordered_map<const void*, Out> edge_of_;
  std::vector<std::size_t> outputs_;  // the function's output each input of this node is
  std::size_t num_outputs_ = 0;
  ::chorus::detail::PhiloxTape tape_;
};

/// Runs `fn` on `inputs` (its tensor arguments that require grad) and returns its outputs,
/// whose graph is one CheckpointBackward node: the function's activations are not kept, and
/// backward recomputes them (Note [activation checkpointing]). `reads` are its other tensor
/// arguments, which must not change in place before backward. With grad mode off, runs fn.
template <class T>
std::vector<Tensor<T>> checkpoint(CheckpointFn<T> fn, std::vector<AnyTensor> inputs, std::vector<AnyTensor> reads) {
  if (!is_grad_enabled()) return fn(inputs);
  auto node = std::make_shared<CheckpointBackward<T>>();
  std::vector<Tensor<T>> outs;
  std::vector<detail::EdgeLog::Entry> out_edges;
  {
    detail::CheckpointScope scope(node->tape_, /*recompute=*/false);
    const auto leaves = detail::checkpoint_leaves(inputs);
    outs = fn(leaves);
    for (const auto& o : outs) gradient_edge(o);  // an output from outside leaves the function too
    out_edges = detail::edges_out(scope.finish(), leaves);
  }
  for (const auto& in : inputs)
    in.visit([&](const auto& t) {
      using U = typename std::decay_t<decltype(t)>::value_type;
      if constexpr (is_floating_v<U>) node->add_next_edge(gradient_edge(t));
      else CHORUS_FAIL("checkpoint: an input of ", dtype_name(in.dtype()), " cannot require grad");
    });
  auto* outer = detail::current_edge_log();  // a checkpoint inside a checkpoint: the outer one's edges too
  for (auto& e : out_edges) {
    if (outer) outer->note(e);
    if (node->edge_of_.count(e.tensor.impl_key())) continue;
    std::size_t index = node->next_edges().size();
    for (std::size_t k = inputs.size(); k < node->next_edges().size(); ++k)
      if (node->next_edges()[k].fn == e.edge.fn && node->next_edges()[k].input_nr == e.edge.input_nr) index = k;
    if (index == node->next_edges().size()) node->add_next_edge(e.edge);
    const void* key = e.tensor.impl_key();
    node->edge_of_.emplace(key, typename CheckpointBackward<T>::Out{std::move(e.tensor), e.version, index});
  }
  std::vector<Tensor<T>> result(outs.size());
  for (std::size_t k = 0; k < outs.size(); ++k) {
    if (!outs[k].defined() || !outs[k].requires_grad()) {
      result[k] = outs[k];
      continue;
    }
    result[k] = outs[k].detach();
    set_history(result[k], node);
    node->outputs_.push_back(k);
  }
  for (const auto& t : inputs) node->read_.push_back({t, detail::storage_version(t)});
  for (const auto& t : reads) node->read_.push_back({t, detail::storage_version(t)});
  node->num_outputs_ = outs.size();
  node->fn_ = std::move(fn);
  node->inputs_ = std::move(inputs);
  return result;
}

}  // namespace autograd
CHORUS_NAMESPACE_END
