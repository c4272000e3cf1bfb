#pragma once
// nn::Module: the registry of parameters, buffers and submodules that every layer and user
// model derives from, plus ModuleHolder (shared handles such as nn::Linear) and clone().
//
// Note [holders]
// As in PyTorch's C++ frontend, a layer is used through a holder (nn::Linear wraps a
// std::shared_ptr<nn::LinearImpl>); copying a holder shares the layer. Submodules are
// registered with register_module() and kept in members of holder type. Deep copies
// (clone(), DataParallel replicas) are made by copy constructors under a CloneScope (Note
// [deep copy through copy constructors]); a submodule kept in a raw std::shared_ptr member
// cannot be remapped that way, and clone() reports it instead of silently sharing it.
//
// Note [tied parameters]
// PyTorch ties weights by assignment (`lm_head.weight = tok_emb.weight`): the module's
// attribute is its registry. A C++ member is a separate handle, so a registry holding its own
// copy of the handle would keep the old tensor after `head->weight = emb->weight` (LibTorch's
// trap: the forward uses the new tensor, parameters() and checkpoints the old one). A member
// registered with its pointer (`register_parameter("weight", &LinearImpl::weight, init)`, as
// every library layer does) is instead read through the member at each walk, so the
// assignment ties: one tensor, one gradient summed over both uses, listed once by
// parameters()/named_parameters() (optimizers, clipping, master weights, DataParallel's flat
// buffers and replicas, DDP and sharding all walk those), saved under both names by
// named_tensors() and checkpoints, as PyTorch's state_dict(). A member left undefined is not
// registered (PyTorch's None); one set to a tensor computed by an op is listed as it is, and
// the optimizers and MasterWeights refuse it (a DataParallel replica's parameters are such
// tensors). Copies (clone(), replicas) keep the tie: the copy scope copies each tensor once.
// Tie before wrapping the module in DataParallel or DDP: they refuse a module whose
// registered tensors changed after they were built.
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "../core/any_tensor.hpp"
#include "../core/profiler.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

class Module;

namespace detail {
using CloneFn = std::shared_ptr<Module> (*)(const Module&);

template <class Impl>
std::shared_ptr<Module> clone_as(const Module& m) {
  return std::make_shared<Impl>(static_cast<const Impl&>(m));
}

/// Under an active CloneScope, the memoised copy of `module`; otherwise `module` itself.
template <class Impl>
std::shared_ptr<Impl> map_module(const std::shared_ptr<Impl>& module, CloneFn clone) {
  if (!module) return module;
  auto* scope = CloneScope::active();
  if (!scope) return module;
  auto copy = scope->map_object(static_cast<const Module*>(module.get()),
                                [&] { return std::static_pointer_cast<void>(clone(*module)); });
  return std::static_pointer_cast<Impl>(std::static_pointer_cast<Module>(copy));
}

CHORUS_INLINE void check_name(const std::string& name, const char* what);
}  // namespace detail

/// The base of every layer and model: a registry of named parameters, buffers and submodules
/// (PyTorch's nn.Module; see Note [holders] and Note [tied parameters]).
class Module {
 public:
  /// A registered tensor with its dotted name.
  struct NamedTensor {
    std::string name;  ///< Dotted path from the module walked (`fc.weight`).
    AnyTensor tensor;  ///< The registered tensor.
  };
  /// A registered submodule.
  struct Child {
    std::string name;                ///< The name it was registered under.
    std::shared_ptr<Module> module;  ///< The submodule.
    detail::CloneFn clone;           ///< Internal: copies the submodule as its concrete Impl type.
  };

  /// A module with nothing registered, in training mode.
  Module() = default;
  /// Copies the registry and training mode; tensors and submodules are shared, except under an
  /// active CloneScope, which maps them to deep copies (Note [deep copy through copy constructors]).
  ///@{
  Module(const Module& other);
  Module& operator=(const Module& other);
  ///@}
  /// Moves the registry and training mode.
  ///@{
  Module(Module&&) noexcept = default;
  Module& operator=(Module&&) noexcept = default;
  ///@}
  CHORUS_INLINE virtual ~Module();

  /// Registers a parameter (a leaf that requires grad unless requires_grad is false).
  template <class T>
  Tensor<T> register_parameter(std::string name, Tensor<T> tensor, bool requires_grad = true);

  /// Registers the member `member` of this module, set to `tensor`, as parameter `name`: the
  /// registry then reads the member, so assigning it later re-registers it, as assigning a
  /// module attribute does in PyTorch (Note [tied parameters]). Every library layer registers
  /// its parameters and buffers this way.
  template <class T, class M>
  Tensor<T>& register_parameter(std::string name, Tensor<T> M::*member, Tensor<T> tensor,
                                bool requires_grad = true) {
    auto m = member_of<M>(member, name);
    this->*m = register_parameter(name, std::move(tensor), requires_grad);
    bind_member(params_.back(), m);
    return this->*m;
  }

  /// Registers a buffer: state that is saved and moved with the module but not trained.
  template <class T>
  Tensor<T> register_buffer(std::string name, Tensor<T> tensor);

  /// Registers the member `member`, set to `tensor`, as buffer `name` (read through the
  /// member, as register_parameter's member form).
  template <class T, class M>
  Tensor<T>& register_buffer(std::string name, Tensor<T> M::*member, Tensor<T> tensor) {
    auto m = member_of<M>(member, name);
    this->*m = register_buffer(name, std::move(tensor));
    bind_member(buffers_.back(), m);
    return this->*m;
  }

  /// Registers a submodule held by a holder (nn::Linear, …) or a std::shared_ptr<Impl>.
  template <class Holder>
  Holder register_module(std::string name, Holder module) {
    detail::check_name(name, "submodule");
    check_unique(name);
    std::shared_ptr<Module> ptr;
    detail::CloneFn clone = nullptr;
    if constexpr (requires { typename Holder::ImplType; }) {
      ptr = module.ptr();
      clone = &detail::clone_as<typename Holder::ImplType>;
    } else {
      static_assert(std::is_base_of_v<Module, typename Holder::element_type>,
                    "register_module takes a module holder or a std::shared_ptr to a Module");
      ptr = module;
      clone = &detail::clone_as<typename Holder::element_type>;
    }
    CHORUS_CHECK(ptr != nullptr, "register_module('", name, "'): empty module");
    children_.push_back({std::move(name), std::move(ptr), clone});
    return module;
  }

  /// Parameters in registration order, this module's first, then each child's (recursively);
  /// a tensor registered under several names (tied) is listed once, at its first name.
  std::vector<AnyTensor> parameters(bool recurse = true) const;
  /// Parameters with dotted names (`fc.weight`); with remove_duplicate false, a tied tensor
  /// under each of its names.
  std::vector<NamedTensor> named_parameters(bool recurse = true, bool remove_duplicate = true) const;
  /// Buffers in registration order, as parameters(): this module's first, then each child's.
  std::vector<AnyTensor> buffers(bool recurse = true) const;
  /// Buffers with dotted names; with remove_duplicate false, a tied tensor under each of its names.
  std::vector<NamedTensor> named_buffers(bool recurse = true, bool remove_duplicate = true) const;
  /// Parameters then buffers, with dotted names (what a checkpoint holds): a tied tensor under
  /// each of its names, as PyTorch's state_dict().
  std::vector<NamedTensor> named_tensors() const;
  /// The direct submodules with their names, in registration order.
  const std::vector<Child>& named_children() const { return children_; }
  /// The direct submodules, in registration order.
  std::vector<std::shared_ptr<Module>> children() const;

  /// Sets training mode here and in every submodule.
  CHORUS_INLINE virtual void train(bool on = true);
  /// Sets evaluation mode here and in every submodule (train(false)).
  void eval() { train(false); }
  /// True in training mode (the default), false after eval().
  bool is_training() const { return training_; }

  /// Moves every parameter and buffer (and accumulated gradient) to `device`, in place: the
  /// tensors keep their identity, so handles held elsewhere see the move. Every copy is made
  /// before the first tensor changes, so a move that fails (memory of `device` exhausted)
  /// leaves the module where it was. A moved leaf gets a new gradient accumulator on first
  /// use (PyTorch resets it when the device changes): one that a graph built before the move
  /// still holds would expect gradients on the old device.
  void to(Device device);

  /// Clears (set_to_none, the default) or zeroes every parameter's gradient.
  void zero_grad(bool set_to_none = true);

  /// The C++ type name of this module (for printing).
  virtual std::string name() const { return "Module"; }

  /// True for a layer whose forward meets the other replicas of a DataParallel (SyncBatchNorm
  /// sums its statistics across them): such replicas must run concurrently, never one after
  /// another on one thread (Note [inline small steps] in parallel/data_parallel.hpp).
  virtual bool meets_other_replicas() const { return false; }
  /// True when this module or any submodule meets_other_replicas().
  bool any_meets_other_replicas() const;

  /// Prints the module tree with parameter shapes.
  void pretty_print(std::ostream& os, int indent = 0) const;

  /// Calls f(AnyTensor&) for every registered parameter and buffer, recursively (a tied
  /// tensor once per name; an unset member, none).
  template <class F>
  void for_each_tensor(F&& f) {
    for (auto* slots : {&params_, &buffers_})
      for (auto& s : *slots) {
        AnyTensor t = current(s);
        if (t.defined()) f(t);
      }
    for (auto& c : children_) c.module->for_each_tensor(f);
  }

  /// The tensor registered as `dotted` (a dotted path), or undefined when there is none.
  AnyTensor find_tensor(const std::string& dotted) const;

 private:
  // A registered tensor: held here, or read through a member of the derived module.
  using MemberRef = std::variant<std::monostate, Tensor<float> Module::*, Tensor<double> Module::*,
                                 Tensor<std::int64_t> Module::*, Tensor<bfloat16> Module::*,
                                 Tensor<half> Module::*>;
  struct Slot {
    std::string name;
    AnyTensor tensor;  // unset for a member slot
    MemberRef member;
  };

  template <class T>
  using MemberPtr = Tensor<T> Module::*;
  template <class M, class T>
  MemberPtr<T> member_of(Tensor<T> M::*member, const std::string& name) {
    static_assert(std::is_base_of_v<Module, M>, "register_parameter/register_buffer: the member must belong to a "
                                                "class derived from nn::Module");
    CHORUS_CHECK(member != nullptr, "register '", name, "': null member pointer");
    CHORUS_CHECK(dynamic_cast<M*>(this) != nullptr, "register '", name,
                 "': the member belongs to a class this module is not (register a module's own members)");
    return static_cast<Tensor<T> Module::*>(member);
  }
  template <class T>
  static void bind_member(Slot& slot, Tensor<T> Module::*member) {
    slot.tensor = AnyTensor();
    slot.member = member;
  }
  /// The tensor `slot` holds now (a member slot: the member's).
  CHORUS_INLINE AnyTensor current(const Slot& slot) const;

  void check_unique(const std::string& name) const;

  void collect(std::vector<NamedTensor>& out, const std::string& prefix, bool recurse,
               std::vector<Slot> Module::*which) const;

  std::vector<Slot> params_;
  std::vector<Slot> buffers_;
  std::vector<Child> children_;
  bool training_ = true;
};

namespace detail {

/// A module whose forward the calling thread runs, with its dotted name (Note [layer spans]).
struct ForwardFrame {
  const Module* module;     ///< The module.
  const std::string* name;  ///< Its dotted name (interned; empty for a root).
};

/// The modules whose forward the calling thread runs, innermost last.
inline std::vector<ForwardFrame>& forward_frames() {
  thread_local std::vector<ForwardFrame> frames;
  return frames;
}

// Note [layer spans]
// While a profiler records, a layer called through its holder (`fc1(x)`, as in LibTorch) or
// from a Sequential gets a forward span named by its dotted path ("layers.0.attn"): the name it
// is registered under in the module whose forward calls it, after that module's own. The
// calling thread keeps the modules whose forward it runs (forward_frames); DataParallel and
// DistributedDataParallel start the frames at the module's root, so the replicas' layers carry
// the module's names. The autograd nodes a layer's forward makes carry the name too
// (profiler::LayerScope), and backward is grouped under it. A root called through its holder
// has a span named by its type, and its layers are named from it ("fc1", as named_parameters()
// names them).

/// The dotted name of `m` called from the innermost frame (its type name outside any).
inline std::string layer_name(const Module& m) {
  const auto& frames = forward_frames();
  if (frames.empty()) return m.name();
  const ForwardFrame& parent = frames.back();
  std::string own = m.name();
  for (const auto& c : parent.module->named_children())
    if (c.module.get() == &m) {
      own = c.name;
      break;
    }
  return parent.name->empty() ? own : *parent.name + "." + own;
}

/// A layer's forward span while alive, if a profiler records layers (Note [layer spans]).
class LayerSpan {
 public:
  /// Enters `m`'s forward.
  explicit LayerSpan(const Module& m) {
    if (!profiler::enabled() || !profiler::options().layers) return;
    // A root is shown by its type; its layers are named from it, as named_parameters() names them.
    const bool root = forward_frames().empty();
    const std::string* name = profiler::detail::intern(layer_name(m));
    forward_frames().push_back({&m, root ? profiler::detail::intern("") : name});
    span_.emplace(profiler::Category::forward, name->c_str());
    layer_.emplace(name);
  }
  ~LayerSpan() {
    if (!span_) return;
    layer_.reset();
    span_.reset();
    forward_frames().pop_back();
  }
  LayerSpan(const LayerSpan&) = delete;
  LayerSpan& operator=(const LayerSpan&) = delete;

 private:
  std::optional<profiler::Scope> span_;
  std::optional<profiler::LayerScope> layer_;
};

/// Names the layers the calling thread calls from `root` by their registered names, without a
/// span of its own (DataParallel's replicas; Note [layer spans]).
class RootFrame {
 public:
  /// Makes `root` the outermost frame while alive.
  explicit RootFrame(const Module& root) {
    if (!profiler::enabled() || !profiler::options().layers) return;
    forward_frames().push_back({&root, profiler::detail::intern("")});
    pushed_ = true;
  }
  ~RootFrame() {
    if (pushed_) forward_frames().pop_back();
  }
  RootFrame(const RootFrame&) = delete;
  RootFrame& operator=(const RootFrame&) = delete;

 private:
  bool pushed_ = false;
};

}  // namespace detail

/// A shared handle to a module implementation (see Note [holders]).
///
/// Note [layer options]
/// A layer's options are a designated-initializer aggregate, braced in the layer's
/// constructor: `nn::Conv2d(3, 8, 3, {.stride = 2, .padding = 1})`, the spelling of
/// `optim::SGD(params, {.lr = 0.05})` and of every other options struct in chorus. Why this
/// and nothing else:
/// - No order trap: C++20 rejects designators out of declaration order (GCC: an error;
///   Clang: -Wreorder-init-list, and it still assigns by name), and a field is named, not
///   placed. Fields follow PyTorch's argument order, so the order to write is PyTorch's.
/// - Sizes per dimension are ExpandingArray (Note [expanding arrays] in core/shape.hpp):
///   `.padding = 1` means (1, 1), `.stride = {2, 1}` two values; nothing is half-filled.
/// - Braces need a known parameter type: ModuleHolder's variadic constructor cannot deduce
///   `{.padding = 1}` (nor `{3, 3}` or a braced Shape), so every library layer has a holder
///   class with explicit, non-template constructors mirroring its Impl's (nn::Conv2dT,
///   nn::LinearT, …). The variadic constructor stays for user holders (CHORUS_MODULE).
/// - LibTorch's chained setters (`Conv2dOptions(3, 8, 3).stride(2)`) are not offered: a
///   setter stride() cannot coexist with the field `stride` that designators name, so they
///   would need a second options type and two spellings of every layer. One way it is.
/// Calling a layer with a tensor of another scalar type, or chaining one in a Sequential of
/// another type, is a static_assert with a readable message (operator() below,
/// SequentialImpl::push_back).
template <class Impl>
class ModuleHolder {
 public:
  using ImplType = Impl;  ///< The module implementation type held.

  /// An empty holder (assign a constructed one later).
  ModuleHolder(std::nullptr_t) {}  // NOLINT
  /// Constructs the implementation from `args`.
  template <class... Args>
    requires(!(sizeof...(Args) == 1 && (std::is_same_v<std::decay_t<Args>, ModuleHolder> && ...)) &&
             std::is_constructible_v<Impl, Args...>)
  explicit ModuleHolder(Args&&... args) : impl_(std::make_shared<Impl>(std::forward<Args>(args)...)) {}
  /// Holds an existing implementation (shared, not copied).
  ModuleHolder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}  // NOLINT

  /// Shares `o`'s module (like std::shared_ptr); under an active CloneScope, holds its deep copy
  /// instead (Note [deep copy through copy constructors]).
  ModuleHolder(const ModuleHolder& o) : impl_(detail::map_module(o.impl_, &detail::clone_as<Impl>)) {}
  /// Shares `o`'s module, or its deep copy under an active CloneScope (as the copy constructor).
  ModuleHolder& operator=(const ModuleHolder& o) {
    impl_ = detail::map_module(o.impl_, &detail::clone_as<Impl>);
    return *this;
  }
  /// Takes over the other holder's module, leaving it empty.
  ModuleHolder(ModuleHolder&&) noexcept = default;
  /// Takes over the other holder's module, leaving it empty.
  ModuleHolder& operator=(ModuleHolder&&) noexcept = default;

  /// Member access to the implementation; throws chorus::Error when the holder is empty.
  Impl* operator->() const { return &checked(); }
  /// The implementation; throws chorus::Error when the holder is empty.
  Impl& operator*() const { return checked(); }
  /// The implementation, or nullptr when empty (unchecked).
  Impl* get() const { return impl_.get(); }
  /// The shared pointer to the implementation.
  const std::shared_ptr<Impl>& ptr() const { return impl_; }
  /// True when the holder holds no implementation.
  bool is_empty() const { return impl_ == nullptr; }
  /// True when the holder holds an implementation.
  explicit operator bool() const { return impl_ != nullptr; }

  /// Calls the implementation's forward().
  template <class... Args>
  decltype(auto) operator()(Args&&... args) const {
    constexpr bool callable = requires(Impl& m, Args&&... a) { m.forward(std::forward<Args>(a)...); };
    static_assert(callable,
                  "this module's forward() cannot be called with these arguments. A layer of one scalar type "
                  "takes tensors of that type only: nn::LinearT<double> takes Tensor<double>, nn::Linear (float) "
                  "takes Tensor<float>; convert the input (x.to<double>()) or build the layers of one type");
    if constexpr (callable) {
      Impl& m = checked();
      const detail::LayerSpan span(m);  // Note [layer spans]
      return m.forward(std::forward<Args>(args)...);
    }
  }
  /// Indexes the implementation (Sequential: `seq[i]`).
  template <class Arg>
    requires requires(Impl& m, Arg&& a) { m[std::forward<Arg>(a)]; }
  decltype(auto) operator[](Arg&& arg) const {
    return checked()[std::forward<Arg>(arg)];
  }

 private:
  Impl& checked() const {
    CHORUS_CHECK(impl_ != nullptr, "accessing an empty module holder");
    return *impl_;
  }
  std::shared_ptr<Impl> impl_;
};

/// The nn::Module behind a holder, a std::shared_ptr, a wrapper with module() (such as
/// DataParallel), or a Module-derived object itself.
template <class M>
Module& module_of(M& m) {
  if constexpr (requires { typename M::ImplType; } || requires { typename M::element_type; }) return *m;
  else if constexpr (requires { m.module(); }) return module_of(m.module());
  else return m;
}
/// The nn::Module behind `m`, read-only (as the non-const overload).
template <class M>
const Module& module_of(const M& m) {
  if constexpr (requires { typename M::ImplType; } || requires { typename M::element_type; }) return *m;
  else if constexpr (requires { m.module(); }) return module_of(m.module());
  else return m;
}

namespace detail {

/// A fresh leaf on `device` holding a copy of `src`'s values (requires_grad kept for leaves).
template <class T>
std::shared_ptr<TensorImpl<T>> deep_copy(const TensorImpl<T>& src, Device device) {
  Tensor<T> view(std::make_shared<TensorImpl<T>>());
  view.impl()->storage = src.storage;
  view.impl()->offset = src.offset;
  view.impl()->shape = src.shape;
  view.impl()->strides = src.strides;
  auto out = Tensor<T>::empty(src.shape, device);
  backend::copy(out, view);
  out.impl()->requires_grad = src.requires_grad && src.grad_fn == nullptr;
  return out.impl();
}

/// Deep copy of every tensor onto one device (see Note [deep copy through copy constructors]).
class DeviceCopyScope final : public CloneScope {
 public:
  explicit DeviceCopyScope(Device device) : device_(device) {}

 protected:
  CHORUS_INLINE std::shared_ptr<void> copy_tensor(const void* impl, DType dtype) override;

 private:
  Device device_;
};

/// Every module below (and including) `m`, with its dotted name.
CHORUS_INLINE void walk(const Module& m, const std::string& prefix,
                        std::vector<std::pair<std::string, const std::shared_ptr<Module>*>>& out);

/// The registered tensors of `root` (named_tensors(): a tied one under each name), as identities.
CHORUS_INLINE std::vector<const void*> registered_keys(const Module& root);
/// Refuses a module whose registered tensors are no longer `keys` (a parameter assigned or
/// tied after `who` was built over it: Note [tied parameters]).
CHORUS_INLINE void check_registry_unchanged(const Module& root, const std::vector<const void*>& keys, const char* who);

/// Copy-constructs `original` while `scope` is active (made by `make_scope`), then checks
/// that no submodule of the original gained a reference (which would mean a raw
/// std::shared_ptr member shares it with the copy).
template <class M, class MakeScope>
M copy_checked(const M& original, MakeScope&& make_scope) {
  std::vector<std::pair<std::string, const std::shared_ptr<Module>*>> subs;
  walk(module_of(original), "", subs);
  std::vector<long> before;
  for (auto& s : subs) before.push_back(s.second->use_count());
  std::optional<M> copy;
  {
    auto scope = make_scope();
    copy.emplace(original);
  }  // the scope ends before the copy is moved out: later copies are plain copies
  for (std::size_t i = 0; i < subs.size(); ++i)
    CHORUS_CHECK(subs[i].second->use_count() <= before[i], "clone: submodule '", subs[i].first,
                 "' is also held by a raw std::shared_ptr member, which a copy would share with the original; "
                 "hold it in a module holder (nn::ModuleHolder / CHORUS_MODULE) instead");
  return std::move(*copy);
}
}  // namespace detail

/// A deep copy of `module` (a holder or a Module-derived class) with every tensor on
/// `device`: fresh parameters (leaves, no gradients), buffers and submodules.
template <class M>
M clone(const M& module, Device device) {
  check_device(device);
  return detail::copy_checked(module, [&] { return std::make_unique<detail::DeviceCopyScope>(device); });
}

}  // namespace nn
CHORUS_NAMESPACE_END

// Module's registry takes every dtype (all listed): its definitions are in module_impl.hpp.
#define CHORUS_NN_MODULE_INSTANCES(X, T)                                              \
  X(Tensor<T> nn::Module::register_parameter<T>(std::string, Tensor<T>, bool)) \
  X(Tensor<T> nn::Module::register_buffer<T>(std::string, Tensor<T>))
CHORUS_EXTERN_INSTANCES(CHORUS_NN_MODULE_INSTANCES, CHORUS_ALL_DTYPES)

/// Declares holder `Name` for the module implementation `NameImpl` (as TORCH_MODULE does).
#define CHORUS_MODULE(Name)                                      \
  class Name : public ::chorus::nn::ModuleHolder<Name##Impl> {   \
   public:                                                       \
    using ::chorus::nn::ModuleHolder<Name##Impl>::ModuleHolder;  \
  }

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "module_impl.hpp"
#endif
