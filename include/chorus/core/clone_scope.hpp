#pragma once
// CloneScope: the mechanism behind deep copies of modules (replication).
//
// Note [deep copy through copy constructors]
// A replica of a user's module must be a deep copy on another device, yet the user's class
// should need no clone() boilerplate. chorus gets there with ordinary copy constructors:
// while a CloneScope is active on a thread, copying a Tensor handle (or a module holder)
// does not share the original's impl but maps it, through the scope, to a deep copy made
// once per original (a memo keyed by the original impl). So `Model copy(original)` run
// inside a scope copies every parameter, buffer and nested holder exactly once, and both
// the registry in nn::Module and the user's own members point at the same new objects.
// The scope pauses itself while it copies a tensor, so the copying code's own handles are
// left alone (module copies run with it active, so nested holders are mapped). Submodules must be held by chorus holders (not raw std::shared_ptr members),
// which nn::Module checks after a clone (see Note [holders] in nn/module.hpp).
#include <functional>
#include <memory>
#include <unordered_map>

#include "../compiled.hpp"
#include "dtype.hpp"

CHORUS_NAMESPACE_BEGIN

template <class T>
struct TensorImpl;

/// While alive, makes copies of Tensor handles (and module holders) on this thread deep copies,
/// one per original (Note [deep copy through copy constructors]); subclasses make the tensor copies.
class CloneScope {
 public:
  CloneScope() : prev_(slot()) { slot() = this; }
  CHORUS_INLINE virtual ~CloneScope();
  CloneScope(const CloneScope&) = delete;
  CloneScope& operator=(const CloneScope&) = delete;

  /// The scope active on the calling thread, or nullptr.
  static CloneScope* active() { return slot(); }

  /// The copy of the tensor impl `old` made in this scope (made now if it is the first time).
  template <class T>
  std::shared_ptr<TensorImpl<T>> map_tensor(const std::shared_ptr<TensorImpl<T>>& old) {
    return std::static_pointer_cast<TensorImpl<T>>(map_object(old.get(), [&] {
      Pause pause;  // the copying code's own tensor handles are plain copies
      return copy_tensor(old.get(), dtype_of<T>());
    }));
  }

  /// Memoised copy of an arbitrary object. Module impls use this; their copy constructors
  /// run with the scope active, so everything they hold is mapped too.
  std::shared_ptr<void> map_object(const void* key, const std::function<std::shared_ptr<void>()>& make);

  /// Suspends the scope on this thread (the copying code's own handles are plain copies).
  class Pause {
   public:
    Pause() : saved_(slot()) { slot() = nullptr; }
    ~Pause() { slot() = saved_; }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    CloneScope* saved_;
  };

 protected:
  /// Makes the deep copy of one tensor impl (`impl` points to a TensorImpl<T> of `dtype`).
  virtual std::shared_ptr<void> copy_tensor(const void* impl, DType dtype) = 0;

 private:
  static CloneScope*& slot() {
    thread_local CloneScope* s = nullptr;
    return s;
  }
  CloneScope* prev_;
  std::unordered_map<const void*, std::shared_ptr<void>> memo_;
};

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "clone_scope_impl.hpp"
#endif
