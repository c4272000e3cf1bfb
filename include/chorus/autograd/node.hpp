#pragma once
// Graph nodes: each recorded operation leaves a Node that maps the gradients of its outputs
// to the gradients of its inputs, plus edges to the nodes that produced those inputs.
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../core/any_tensor.hpp"
#include "../core/profiler.hpp"
#include "../core/runtime.hpp"
#include "grad_mode.hpp"

CHORUS_NAMESPACE_BEGIN
namespace autograd {

class NodeBase;

/// Where a gradient goes: input `input_nr` of node `fn` (an empty edge means nowhere). The
/// node may take gradients of another dtype than the one the edge leaves from (Note [one
/// graph over every dtype]).
struct Edge {
  std::shared_ptr<NodeBase> fn;  ///< The node the gradient goes to (null: nowhere).
  std::uint32_t input_nr = 0;    ///< Which of `fn`'s inputs (its forward outputs) receives it.
  /// Whether the edge leads to a node.
  bool valid() const { return fn != nullptr; }
};

namespace detail {
/// The replica whose forward the calling thread runs (-1 outside DataParallel's replicas).
inline int& current_replica() {
  thread_local int r = -1;
  return r;
}

/// The failure flag of the backward pass whose node the calling thread runs (null outside one).
inline const std::atomic<bool>*& backward_failed_flag() {
  thread_local const std::atomic<bool>* flag = nullptr;
  return flag;
}

/// Marks the calling thread as running a node of the backward pass with flag `failed`.
class BackwardScope {
 public:
  explicit BackwardScope(const std::atomic<bool>* failed) : prev_(std::exchange(backward_failed_flag(), failed)) {}
  ~BackwardScope() { backward_failed_flag() = prev_; }
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  const std::atomic<bool>* prev_;
};

inline std::uint64_t next_sequence_nr() {
  static std::atomic<std::uint64_t> n{0};
  return n.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace detail

// Note [giving up in backward]
// Once a node of a backward pass has failed, the engine schedules nothing more, so a node
// that waits for its peers on other replicas (SyncBatchNorm's statistics reduction) would
// wait for nodes that never run. Such a node checks backward_failed() while it waits and
// gives up; the engine reports the first failure, never the give-up.

/// True while the calling thread runs a node of a backward pass.
inline bool in_backward() { return detail::backward_failed_flag() != nullptr; }
/// True when the backward pass whose node the calling thread runs has failed elsewhere
/// (Note [giving up in backward]).
inline bool backward_failed() {
  const auto* f = detail::backward_failed_flag();
  return f && f->load(std::memory_order_acquire);
}

// Note [one graph over every dtype]
// One backward pass walks nodes of every dtype: a conversion (x.to<bfloat16>()) records a
// node that takes the gradient in one dtype and hands it on in another, so a float32 loss
// over a bfloat16 model's output, or a bfloat16 layer inside a float32 model, is one graph.
// The engine sees only NodeBase: edges lead to any node, gradients travel as AnyTensor, and
// each node's dtype() says what it takes (the engine checks every gradient it hands over).
// Node<T> is the typed base that almost every operation derives from: its apply() maps
// Tensor<T> gradients to Tensor<T> gradients. A node between two dtypes (ConvertBackward)
// derives from Node<To> for its inputs and overrides apply_any() for its outputs.

/// What the engine knows of a node, whatever its dtype.
class NodeBase {
 public:
  NodeBase()
      : seq_(detail::next_sequence_nr()),
        layer_(profiler::enabled() ? profiler::detail::current_layer() : nullptr) {}
  virtual ~NodeBase() = default;
  NodeBase(const NodeBase&) = delete;
  NodeBase& operator=(const NodeBase&) = delete;

  /// The node's name for error messages ("AccumulateGrad", "CheckpointBackward", …).
  virtual std::string name() const = 0;
  /// The dtype of the gradients this node takes (one per forward output).
  virtual DType dtype() const = 0;
  /// Maps the gradients that arrived for each input (several are summed; none means zeros)
  /// to one gradient per next edge, each of its edge's node's dtype (undefined where an
  /// input needs none, or an empty list for none at all).
  virtual std::vector<AnyTensor> apply_any(std::vector<std::vector<AnyTensor>>&& arrived) = 0;
  /// Frees saved tensors once backward has run through this node (unless retain_graph).
  virtual void release_saved() {}
  /// False for nodes that outlive one graph (AccumulateGrad is shared by every backward).
  virtual bool releasable() const { return true; }
  /// The device whose memory should hold the sum of gradients arriving at one input, if any
  /// (an AccumulateGrad whose leaf's gradient is kept on another device).
  virtual std::optional<Device> gradient_memory() const { return std::nullopt; }

  /// The number of gradients this node receives (one per forward output recorded by add_input()).
  std::uint32_t num_inputs() const { return static_cast<std::uint32_t>(input_meta_.size()); }
  /// The edges this node's gradients go along, one per output of apply_any().
  ///@{
  const std::vector<Edge>& next_edges() const { return next_; }
  std::vector<Edge>& mutable_next_edges() { return next_; }
  ///@}
  /// The order of creation among all nodes (a node made later has a larger number).
  std::uint64_t sequence_nr() const { return seq_; }
  /// The dotted name of the layer whose forward made this node, when a profiler recorded then
  /// (null otherwise): its backward is grouped under that layer.
  const std::string* layer() const { return layer_; }

  /// The stream this node's backward runs on (where its forward ran; see Note [streams]).
  Stream* stream() const { return stream_; }
  /// The device of stream() (the default Device when no stream is set).
  Device device() const { return stream_ ? stream_->device() : Device{}; }
  /// Sets the stream this node's backward runs on.
  void set_stream(Stream* s) { stream_ = s; }

  /// The shape and device of one forward output, which its gradient must have.
  struct InputMeta {
    Shape shape;    ///< The output's shape.
    Device device;  ///< The output's device.
  };
  /// Registers one more forward output (one more gradient this node receives).
  std::uint32_t add_input(const Shape& shape, Device device) {
    input_meta_.push_back({shape, device});
    return static_cast<std::uint32_t>(input_meta_.size() - 1);
  }
  /// The shape and device of input i (forward output i); i is not checked.
  const InputMeta& input_meta(std::uint32_t i) const { return input_meta_[i]; }

  /// Appends an edge to next_edges().
  void add_next_edge(Edge e) { next_.push_back(std::move(e)); }
  /// The DataParallel replica whose forward recorded this node (-1: none), for error messages.
  int replica() const { return replica_; }
  /// Sets replica().
  void set_replica(int r) { replica_ = r; }
  /// Where this node runs, for error messages: "in replica 2 on cpu:2" or "on cpu:0".
  std::string where() const {
    return (replica_ >= 0 ? "in replica " + std::to_string(replica_) + " " : std::string()) + "on " + device().str();
  }

  /// Set by the engine after release_saved(); a second backward then fails clearly.
  bool released() const { return released_; }
  /// Sets released() and drops the saved tensors' version records (called by the engine).
  void mark_released() {
    released_ = true;
    num_saved_ = 0;
    for (auto& sv : saved_) sv.storage.reset();
  }

  /// Records the version of a tensor this node saves for backward; the engine checks it is
  /// unchanged before apply() (Note [version counter]). Returns `t` for use in initialisers.
  template <class U>
  const Tensor<U>& save_version(const Tensor<U>& t) {
    if (!t.defined() || !t.impl()->storage) return t;
    CHORUS_CHECK(num_saved_ < kMaxSaved, name(), ": saves more than ", kMaxSaved, " tensors");
    saved_[num_saved_++] = {t.impl()->storage, t.impl()->storage->version(), Tensor<U>::dtype(), t.shape()};
    return t;
  }
  /// Throws (with PyTorch's wording) when a saved tensor was written in place after it was saved.
  void check_saved_versions() const {
    for (int i = 0; i < num_saved_; ++i) {
      const auto& sv = saved_[i];
      const auto now = sv.storage->version();
      CHORUS_CHECK(now == sv.version,
                   "one of the variables needed for gradient computation has been modified by an inplace "
                   "operation: [",
                   dtype_name(sv.dtype), " ", sv.shape, "], saved by ", name(), ", is at version ", now,
                   "; expected version ", sv.version,
                   " instead. Write into a copy (clone()) of a tensor that autograd saved, or run backward before "
                   "changing it");
    }
  }

 private:
  struct SavedVersion {
    Storage storage;
    std::uint64_t version = 0;
    DType dtype = DType::Float32;
    Shape shape;
  };
  static constexpr int kMaxSaved = 4;
  std::array<SavedVersion, kMaxSaved> saved_{};
  int num_saved_ = 0;

  std::vector<Edge> next_;
  std::vector<InputMeta> input_meta_;
  Stream* stream_ = nullptr;
  int replica_ = -1;
  std::uint64_t seq_;
  const std::string* layer_;
  bool released_ = false;
};


namespace detail {
/// The gradients that arrived for each input of `node`, one per input: summed where several
/// arrived, zeros where none did, contiguous (nodes may assume contiguous gradients).
template <class T>
std::vector<Tensor<T>> gradients_in(const NodeBase& node, std::vector<std::vector<AnyTensor>>&& arrived);
}  // namespace detail

/// A node whose gradients, in and out, are Tensor<T>: every operation within one dtype.
template <class T>
class Node : public NodeBase {
 public:
  /// The gradients apply() takes and returns.
  using TensorList = std::vector<Tensor<T>>;

  DType dtype() const override { return dtype_of<T>(); }
  /// Maps output gradients (one per forward output, never undefined: the engine fills zeros)
  /// to input gradients (one per next edge; undefined where an input needs none).
  virtual TensorList apply(TensorList&& grads) = 0;

  std::vector<AnyTensor> apply_any(std::vector<std::vector<AnyTensor>>&& arrived) override {
    auto outs = apply(detail::gradients_in<T>(*this, std::move(arrived)));
    return std::vector<AnyTensor>(std::make_move_iterator(outs.begin()), std::make_move_iterator(outs.end()));
  }
};

/// The sink of a leaf: adds incoming gradients into the leaf's grad().
template <class T>
class AccumulateGrad final : public Node<T> {
 public:
  /// The accumulator of the leaf `variable`, taking one gradient of its shape and device.
  explicit AccumulateGrad(std::shared_ptr<TensorImpl<T>> variable) : variable_(std::move(variable)) {
    this->add_input(variable_->shape, variable_->device());
  }
  /// The node's name, "AccumulateGrad".
  std::string name() const override { return "AccumulateGrad"; }
  bool releasable() const override { return false; }
  std::optional<Device> gradient_memory() const override {
    if (variable_->grad_keeper) return variable_->grad_keeper->device();
    return std::nullopt;
  }
  /// Adds the gradient into the leaf's grad (or the grad_keeper's, where it has one), taking the
  /// incoming tensor when nothing else shares it; returns no gradients.
  typename Node<T>::TensorList apply(typename Node<T>::TensorList&& grads) override;
  /// The leaf whose gradient this node accumulates.
  const std::shared_ptr<TensorImpl<T>>& variable() const { return variable_; }

 private:
  std::shared_ptr<TensorImpl<T>> variable_;
};

namespace detail {
inline std::mutex& accumulator_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace detail

/// The AccumulateGrad node of a leaf that requires grad (made on first use, then shared).
/// A cached one made for another device or shape (the leaf was moved, Module::to, or
/// re-seated while an old graph still holds the node) is replaced, as PyTorch resets it when
/// the data changes device: its gradients would be refused for the leaf's new device.
template <class T>
std::shared_ptr<Node<T>> grad_accumulator(const Tensor<T>& leaf) {
  auto& impl = *leaf.impl();
  std::lock_guard<std::mutex> lk(detail::accumulator_mutex());
  if (auto acc = impl.grad_accumulator.lock()) {
    const auto& meta = acc->input_meta(0);
    if (meta.device == impl.device() && meta.shape == impl.shape) return acc;
  }
  auto acc = std::make_shared<AccumulateGrad<T>>(leaf.impl());
  acc->set_stream(&current_stream(leaf.device()));
  impl.grad_accumulator = acc;
  return acc;
}

namespace detail {
/// The edges out of a checkpointed function that its operations took from tensors: each tensor
/// (by identity, kept alive) with the edge gradient_edge gave for it, where that edge leads to a
/// node made before the function began (`start`) or to a leaf's accumulator (Note [activation
/// checkpointing] in autograd/checkpoint.hpp).
struct EdgeLog {
  struct Entry {
    AnyTensor tensor;
    std::uint64_t version;  // of its storage then (Note [version counter])
    Edge edge;
  };
  std::uint64_t start = 0;  // the first sequence number of the function's own nodes
  std::vector<Entry> entries;
  bool leaves_function(const Edge& e) const { return !e.fn->releasable() || e.fn->sequence_nr() < start; }
  void note(Entry e) {
    if (leaves_function(e.edge)) entries.push_back(std::move(e));
  }
};
/// The log of the checkpointed function the calling thread runs (null outside one).
inline EdgeLog*& current_edge_log() {
  thread_local EdgeLog* log = nullptr;
  return log;
}
}  // namespace detail

/// Where the gradient of `t` must go: its grad_fn, its accumulator, or nowhere.
template <class T>
Edge gradient_edge(const Tensor<T>& t) {
  if (!t.defined()) return {};
  Edge e;
  if (t.grad_fn()) e = {t.grad_fn(), t.output_nr()};
  else if (t.requires_grad()) e = {grad_accumulator(t), 0};
  else return {};
  if (auto* log = detail::current_edge_log())
    log->note({t, t.impl()->storage ? t.impl()->storage->version() : 0, e});
  return e;
}

/// True when grad mode is on and any of the tensors requires grad.
template <class... Ts>
bool needs_grad(const Ts&... ts) {
  return is_grad_enabled() && (... || (ts.defined() && ts.requires_grad()));
}

/// Makes node `NodeT` with next edges to `inputs`, ready for set_history().
template <class NodeT, class T, class... Args>
std::shared_ptr<NodeT> make_node(std::initializer_list<const Tensor<T>*> inputs, Args&&... args) {
  auto node = std::make_shared<NodeT>(std::forward<Args>(args)...);
  for (const auto* in : inputs) node->add_next_edge(in ? gradient_edge(*in) : Edge{});
  return node;
}

/// Marks the calling thread as running replica `r`'s forward while alive, so that the nodes it
/// records name the replica when their backward fails (as forward's errors do).
class ReplicaGuard {
 public:
  /// Sets the calling thread's replica to `r` (restored by the destructor).
  explicit ReplicaGuard(int r) : prev_(std::exchange(detail::current_replica(), r)) {}
  ~ReplicaGuard() { detail::current_replica() = prev_; }
  ReplicaGuard(const ReplicaGuard&) = delete;
  ReplicaGuard& operator=(const ReplicaGuard&) = delete;

 private:
  int prev_;
};

/// Records `node` as the producer of `out` (its next forward output).
template <class T>
void set_history(Tensor<T>& out, const std::shared_ptr<NodeBase>& node) {
  auto& impl = *out.impl();
  CHORUS_CHECK(node->dtype() == dtype_of<T>(), node->name(), " takes ", dtype_name(node->dtype()),
               " gradients and cannot record a ", dtype_name(dtype_of<T>()), " output");
  if (!node->stream()) node->set_stream(&current_stream(out.device()));
  if (node->replica() < 0) node->set_replica(detail::current_replica());
  impl.output_nr = node->add_input(impl.shape, out.device());
  impl.grad_fn = node;
  impl.requires_grad = true;
}

}  // namespace autograd
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_AUTOGRAD_NODE_INSTANCES(X, T)                                     \
  X(void autograd::set_history<T>(Tensor<T>&, const std::shared_ptr<NodeBase>&))
CHORUS_EXTERN_INSTANCES(CHORUS_AUTOGRAD_NODE_INSTANCES, CHORUS_ALL_DTYPES)
