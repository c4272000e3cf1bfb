#pragma once
// The backward engine's definitions: engine.hpp includes this only in the header-only form;
// src/autograd/engine.cpp compiles them into chorus::compiled for the floating dtypes (Note
// [compiled chorus]), which are all backward() takes.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine.hpp"

CHORUS_NAMESPACE_BEGIN
namespace autograd {

template <class T>
typename Node<T>::TensorList AccumulateGrad<T>::apply(typename Node<T>::TensorList&& grads) {
  Tensor<T> g = std::move(grads[0]);
  CHORUS_CHECK(g.shape() == variable_->shape, "AccumulateGrad: gradient of shape ", g.shape(),
               " for a leaf of shape ", variable_->shape);
  CHORUS_CHECK(g.device() == variable_->device(), "AccumulateGrad: gradient on ", g.device(), " for a leaf on ",
               variable_->device());
  // A gradient kept on another device (DataParallel::shard_gradients) accumulates there: the
  // sum travels now, while backward still runs, and the leaf's device keeps none of it.
  auto& var = variable_->grad_keeper ? *variable_->grad_keeper : *variable_;
  bool handover = true;  // g's memory may become the gradient
  if (g.device() != var.device()) {
    if (g.device().is_cpu() && var.device().is_cpu() && g.is_contiguous()) {
      // CPU devices share the host's memory (Note [host aliases]): g is read where it is, and
      // handed over only when that device allocated it (the replica there made the sum).
      handover = memory_device(g.impl()->storage) == var.device();
      auto view = std::make_shared<TensorImpl<T>>();
      view->storage = make_alias_storage(var.device(), g.impl()->storage,
                                         static_cast<std::size_t>(g.storage_offset()) * sizeof(T),
                                         static_cast<std::size_t>(g.numel()) * sizeof(T));
      view->shape = g.shape();
      view->strides = g.strides();
      g = Tensor<T>(std::move(view));
    } else {
      g = g.to(var.device());
    }
  }
  if (!var.grad) {
    // Steal the incoming gradient when nothing else can see its storage; copy otherwise.
    if (handover && detail::exclusively_owned(g)) {
      var.grad = g.impl();
    } else {
      auto copy = Tensor<T>::empty(g.shape(), g.device());
      backend::copy(copy, g);
      var.grad = copy.impl();
    }
  } else {
    Tensor<T> acc(var.grad);
    // The existing grad is written in place over g's elements: it must have g's extent (it
    // may have been set by hand, or a stale one survived a change of the leaf).
    CHORUS_CHECK(acc.shape() == var.shape && acc.device() == var.device(), "AccumulateGrad: the existing grad (",
                 acc.shape(), " on ", acc.device(), ") does not match its leaf (", var.shape, " on ", var.device(),
                 ")");
    Tensor<T> gc = g;
    if (!gc.is_contiguous()) {
      gc = Tensor<T>::empty(g.shape(), g.device());
      backend::copy(gc, g);
    }
    CHORUS_CHECK(acc.is_contiguous(), "AccumulateGrad: existing grad is not contiguous");
    backend::binary_same(acc, gc, acc, backend::fn::Add{});
  }
  return {};
}

namespace detail {

/// chorus::Error with `what`, the exception being handled nested in it (std::rethrow_if_nested
/// recovers the original, type and all). Call it inside a catch block.
inline std::exception_ptr nested_error(const std::string& what) {
  try {
    std::throw_with_nested(Error(what));
  } catch (...) {
    return std::current_exception();
  }
}


// Note [gradients add in graph order]
// Gradients that meet at one input (a tensor used twice; a DataParallel primary parameter,
// which gets replica 0's gradient and the replicas' sum) arrive in an order that depends on
// which device's thread finished first. Floating-point addition is not associative: summed
// as they arrive, the last bits would depend on that timing, and a DataParallel run would not
// repeat itself. Each arrival carries its producer's place in the discovery walk from the roots
// (fixed by the graph), and the node adds them in that order; sum_into_unshared adds its
// parts left to right whichever part's memory it writes into. The same program and seed
// give the same bits however the devices' work is timed.

/// One backward pass over nodes of any dtype (Note [multi-device backward], Note [one graph
/// over every dtype]).
class GraphTask {
 public:
  using NodePtr = std::shared_ptr<NodeBase>;

  GraphTask(bool retain_graph, Stream* home) : retain_(retain_graph), home_(home) {}

  /// Makes the nodes of `stops` ends of the walk: they never run, and the gradients that reach
  /// them stay for captured() (call before compute_dependencies).
  void stop_at(const std::vector<Edge>& stops) {
    for (const auto& e : stops)
      if (e.valid()) stops_.insert(e.fn.get());
  }

  /// Counts, for every node reachable from `roots`, the edges that lead to it.
  void compute_dependencies(const std::vector<Edge>& roots) {
    std::vector<NodeBase*> stack;
    auto discover = [&](const Edge& e) {
      if (seen_.insert({e.fn.get(), {e.fn, seen_.size()}}).second && !stops_.count(e.fn.get()))
        stack.push_back(e.fn.get());
    };
    for (const auto& e : roots)
      if (e.valid()) discover(e);
    while (!stack.empty()) {
      NodeBase* n = stack.back();
      stack.pop_back();
      for (const auto& e : n->next_edges()) {
        if (!e.valid()) continue;
        ++deps_[e.fn.get()];
        discover(e);
      }
    }
  }

  /// After run(): the gradient that reached each stop edge, its arrivals summed in graph order
  /// (undefined where none arrived).
  std::vector<AnyTensor> captured(const std::vector<Edge>& stops) {
    std::vector<AnyTensor> out(stops.size());
    for (std::size_t k = 0; k < stops.size(); ++k) {
      const auto it = stops[k].valid() ? buffers_.find(stops[k].fn.get()) : buffers_.end();
      if (it == buffers_.end() || stops[k].input_nr >= it->second.size()) continue;
      auto& arrivals = it->second[stops[k].input_nr];
      in_graph_order(arrivals);
      auto parts = take_arrivals(arrivals);
      arrivals.clear();
      if (parts.empty()) continue;
      out[k] = visit_dtype(parts[0].dtype(), [&](auto tag) -> AnyTensor {
        using T = decltype(tag);
        if constexpr (is_floating_v<T>) {
          std::vector<Tensor<T>> typed;
          for (auto& p : parts) typed.push_back(std::move(p.template as<T>()));
          return sum_into_unshared(typed);
        } else {
          CHORUS_FAIL("autograd: a ", dtype_name(parts[0].dtype()), " gradient reached ", stops[k].fn->name());
        }
      });
    }
    return out;
  }

  /// Adds the seed gradients to the root nodes' inputs and runs the graph.
  void run(const std::vector<Edge>& roots, std::vector<AnyTensor> seeds) {
    std::vector<NodeBase*> ready;
    {
      std::lock_guard<std::mutex> lk(m_);
      for (std::size_t i = 0; i < roots.size(); ++i) add_input(roots[i], std::move(seeds[i]), 0);
      for (const auto& e : roots) {
        NodeBase* n = e.fn.get();
        if (deps_[n] == 0 && scheduled_.insert(n).second) ready.push_back(n);
      }
    }
    for (NodeBase* n : ready) schedule(n);
    coordinate();
  }

 private:
  struct Arrival {
    AnyTensor grad;
    std::optional<Event> ready;  // CUDA, other stream: recorded where the gradient was produced
    std::size_t from;            // the producer's place in the graph (Note [gradients add in graph order])
  };

  // Only records the gradient (m_ held); several gradients for one input are summed by
  // the thread that runs the node, outside the lock (Note [multi-device backward]).
  void add_input(const Edge& e, AnyTensor g, std::size_t from) {
    auto& buf = buffers_[e.fn.get()];
    if (buf.empty()) buf.resize(e.fn->num_inputs());
    Arrival a{std::move(g), std::nullopt, from};
    if (a.grad.device().is_cuda()) {  // produced on this thread's current stream for its device
      Stream& produced = current_stream(a.grad.device());
      if (e.fn->stream() != &produced) {  // the consumer runs elsewhere: it must wait for it
        a.ready.emplace();
        a.ready->record(produced);
      }
    }
    buf[e.input_nr].push_back(std::move(a));
  }

  /// Puts a node's arrivals in their producers' order (Note [gradients add in graph order]).
  static void in_graph_order(std::vector<Arrival>& arrivals) {
    if (arrivals.size() < 2) return;
    std::vector<std::size_t> order(arrivals.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return arrivals[a].from < arrivals[b].from; });
    std::vector<Arrival> sorted;
    sorted.reserve(arrivals.size());
    for (auto k : order) sorted.push_back(std::move(arrivals[k]));
    arrivals = std::move(sorted);
  }

  /// Orders the consumer's stream after each gradient's producer and notes the use of its
  /// memory there (CUDA; see Note [CUDA allocator]).
  static std::vector<AnyTensor> take_arrivals(std::vector<Arrival>& arrivals) {
    std::vector<AnyTensor> out;
    for (auto& a : arrivals) {
      if (a.ready) {
        Stream& s = current_stream(a.grad.device());
        a.ready->block(s);
        a.grad.visit([&](const auto& t) { record_stream(t.impl()->storage->data(), t.device(), s); });
      }
      out.push_back(std::move(a.grad));
    }
    return out;
  }

  void schedule(NodeBase* n) {
    if (stops_.count(n)) return;  // its gradients wait in buffers_ for captured()
    {
      std::lock_guard<std::mutex> lk(m_);
      ++outstanding_;
    }
    if (n->stream() == nullptr || n->stream() == home_) {
      std::lock_guard<std::mutex> lk(m_);
      local_.push_back(n);
      cv_.notify_all();
      return;
    }
    const bool grad_mode = is_grad_enabled();
    n->stream()->post([this, n, grad_mode] {
      GradModeGuard g(grad_mode);
      execute(n);
    });
  }

  void execute(NodeBase* n) {
    std::vector<NodeBase*> ready;
    std::exception_ptr failure;
    const BackwardScope in_backward(&failed_);
    try {
      std::vector<std::vector<Arrival>> arrived;
      {
        std::lock_guard<std::mutex> lk(m_);
        if (error_) throw Skip{};
        arrived = std::move(buffers_[n]);
        buffers_.erase(n);
      }
      std::vector<std::vector<AnyTensor>> inputs(arrived.size());
      for (std::size_t i = 0; i < arrived.size(); ++i) {
        in_graph_order(arrived[i]);
        inputs[i] = take_arrivals(arrived[i]);
        for (const auto& in : inputs[i])  // a node of another dtype handed on a wrong gradient
          CHORUS_CHECK(in.dtype() == n->dtype(), n->name(), " received a ", dtype_name(in.dtype()),
                       " gradient for its input ", i, "; it takes ", dtype_name(n->dtype()));
      }
      CHORUS_CHECK(!n->released(), "backward through ", n->name(),
                   " a second time: its saved tensors were freed after the first backward "
                   "(pass retain_graph=true to the first call)");
      n->check_saved_versions();  // Note [version counter]
      profiler::Scope span(profiler::Category::backward,
                           [&] { return n->layer() ? *n->layer() : n->name(); });
      if (span.active()) {
        span.set_device(n->num_inputs() > 0 ? n->input_meta(0).device : n->device());
        span.set_detail(n->name());
      }
      auto outputs = n->apply_any(std::move(inputs));
      if (!retain_ && n->releasable()) {
        n->release_saved();
        n->mark_released();
      }
      const auto& edges = n->next_edges();
      CHORUS_CHECK(outputs.size() == edges.size() || outputs.empty(), n->name(), " returned ", outputs.size(),
                   " gradients for ", edges.size(), " inputs");
      // As PyTorch's validate_outputs: a gradient must have its input's shape and device, or
      // the sums and kernels downstream would read and write past its end.
      for (std::size_t i = 0; i < outputs.size(); ++i) {
        if (!edges[i].valid() || !outputs[i].defined()) continue;
        const auto& meta = edges[i].fn->input_meta(edges[i].input_nr);
        CHORUS_CHECK(outputs[i].shape() == meta.shape && outputs[i].device() == meta.device &&
                         outputs[i].dtype() == edges[i].fn->dtype(),
                     n->name(), " returned a ", dtype_name(outputs[i].dtype()), " gradient of shape ",
                     outputs[i].shape(), " on ", outputs[i].device(), " for input ", i, ", expected ",
                     dtype_name(edges[i].fn->dtype()), " of shape ", meta.shape, " on ", meta.device);
      }
      std::lock_guard<std::mutex> lk(m_);
      const std::size_t from = seen_.at(n).order;
      for (std::size_t i = 0; i < edges.size(); ++i) {
        const auto& e = edges[i];
        if (!e.valid()) continue;
        if (i < outputs.size() && outputs[i].defined()) add_input(e, std::move(outputs[i]), from);
        if (--deps_[e.fn.get()] == 0 && scheduled_.insert(e.fn.get()).second) ready.push_back(e.fn.get());
      }
    } catch (const Skip&) {
    } catch (const std::exception& err) {
      // Only chorus::Error leaves the library: a std exception of a node (std::bad_alloc, one
      // thrown by a user's node) is wrapped too, naming the node and its device as forward's
      // parallel_apply names the replica and device; the original stays nested in it.
      failure = nested_error("in backward of " + n->name() + " " + n->where() + ": " + err.what());
    } catch (...) {
      failure = nested_error("in backward of " + n->name() + " " + n->where() + ": unknown exception");
    }
    if (failure) record_error(std::move(failure));  // after the handler let go (see Future)
    for (NodeBase* r : ready) schedule(r);
    std::lock_guard<std::mutex> lk(m_);
    --outstanding_;
    cv_.notify_all();
  }

  void record_error(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(m_);
    if (!error_) error_ = std::move(e);
    failed_.store(true, std::memory_order_release);  // after error_: a node that gives up is never first
  }

  void coordinate() {
    for (;;) {
      NodeBase* n = nullptr;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [this] { return !local_.empty() || outstanding_ == 0; });
        if (local_.empty()) break;  // outstanding_ == 0: done
        n = local_.front();
        local_.pop_front();
      }
      execute(n);
    }
    if (error_) std::rethrow_exception(error_);
  }

  struct Skip {};

  bool retain_;
  Stream* home_;
  std::mutex m_;
  std::condition_variable cv_;
  struct Seen {
    NodePtr node;       // keeps every node alive during the run
    std::size_t order;  // of discovery from the roots: fixed by the graph
  };
  std::unordered_map<NodeBase*, Seen> seen_;
  std::unordered_map<NodeBase*, int> deps_;
  std::unordered_map<NodeBase*, std::vector<std::vector<Arrival>>> buffers_;  // [node][input]
  std::unordered_set<NodeBase*> scheduled_;
  std::unordered_set<NodeBase*> stops_;  // stop_at(): reached, never run
  std::deque<NodeBase*> local_;
  int outstanding_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};  // error_ is set (Note [giving up in backward])
};

CHORUS_INLINE std::vector<AnyTensor> grad_at(const std::vector<Edge>& roots, std::vector<AnyTensor> seeds,
                                             const std::vector<Edge>& stops, Stream* home) {
  CHORUS_CHECK(roots.size() == seeds.size(), "grad_at: ", roots.size(), " roots but ", seeds.size(), " seeds");
  NoGradGuard no_grad;
  GraphTask task(/*retain_graph=*/false, home);
  task.stop_at(stops);
  task.compute_dependencies(roots);
  task.run(roots, std::move(seeds));
  return task.captured(stops);
}

}  // namespace detail

template <class T>
void backward(const std::vector<Tensor<T>>& roots, const std::vector<Tensor<T>>& grads, bool retain_graph) {
  static_assert(is_floating_v<T>, "backward() needs a floating-point tensor");
  CHORUS_CHECK(grads.empty() || grads.size() == roots.size(), "backward: ", roots.size(), " roots but ",
               grads.size(), " gradients");
  CHORUS_CHECK(!roots.empty(), "backward: no roots");
  std::vector<Edge> edges;
  std::vector<AnyTensor> seeds;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const auto& r = roots[i];
    CHORUS_CHECK(r.defined(), "backward: root ", i, " is an undefined tensor");
    CHORUS_CHECK(r.requires_grad(), "backward: root ", i,
                 " does not require grad and has no grad_fn (was it computed under NoGradGuard, "
                 "or from tensors that do not require grad?)");
    Tensor<T> seed = i < grads.size() ? grads[i] : Tensor<T>();
    if (!seed.defined()) {
      CHORUS_CHECK(r.numel() == 1, "backward: a gradient can be created implicitly only for a one-element "
                                   "output, but the output has shape ",
                   r.shape(), "; pass a gradient of that shape");
      seed = Tensor<T>::empty(r.shape(), r.device());
      backend::fill(seed, T(1));
    } else {
      CHORUS_CHECK(seed.shape() == r.shape(), "backward: gradient of shape ", seed.shape(),
                   " for an output of shape ", r.shape());
      CHORUS_CHECK(seed.device() == r.device(), "backward: gradient on ", seed.device(), " for an output on ",
                   r.device());
    }
    edges.push_back(gradient_edge(r));
    seeds.push_back(std::move(seed));
  }
  Stream* home = ::chorus::detail::worker_stream_of_thread();
  if (!home) home = &current_stream(roots[0].device());
  NoGradGuard no_grad;  // backward itself is not recorded
  detail::GraphTask task(retain_graph, home);
  task.compute_dependencies(edges);
  task.run(edges, std::move(seeds));
}

}  // namespace autograd

CHORUS_NAMESPACE_END
