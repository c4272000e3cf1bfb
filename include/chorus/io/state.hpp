#pragma once
// Loading a module's state (parameters and buffers) by name: from a checkpoint file
// (safetensors.hpp) or from another module in memory. Both go through load_named below, so
// both match names, dtypes and shapes the same way, fail with the same messages, and check
// everything before writing anything (Note [checkpoint safety] in safetensors.hpp).
//
// Note [changing a model's dtype]
// PyTorch changes a model's dtype in place (`model.to(torch.bfloat16)`): its layers hold
// untyped tensors. A chorus layer's scalar type is its C++ type (nn::LinearT<bfloat16> is
// another class than nn::LinearT<float>; its forward is compiled for that type), so a model
// cannot become 16-bit in place without every typed handle in it going stale. The chorus
// spelling is therefore the one PyTorch users write to copy weights between two models,
// `b.load_state_dict(a.state_dict())`, as chorus spells checkpoint loading:
//
//     NetT<bfloat16> low(...);                           // the same architecture, 16-bit
//     load(low, model, {.convert_dtype = true});         // model's values, each rounded once
//
// Like loading a bf16 checkpoint into a float32 module, a dtype change has to be asked for
// (`convert_dtype`); without it a mismatch is an error naming both dtypes, so an accidental
// narrowing is never silent. Integer tensors are never converted.
#include <concepts>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../nn/module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace io {

/// How a load matches the source's tensor names to the module's (files and modules alike).
struct LoadOptions {
  /// Removed from the front of every source name that starts with it before matching, as
  /// PyTorch's consume_prefix_in_state_dict_if_present does: "module." loads a file saved
  /// from a model wrapped in PyTorch's nn.DataParallel into the bare module.
  std::string strip_prefix = {};
  /// Converts a floating-point tensor whose dtype in the source differs from the module's (a
  /// bfloat16 checkpoint into a float32 module, or back), each value rounded once to nearest
  /// even. Off by default: a mismatch is an error naming both dtypes. Integer tensors are
  /// never converted (Note [changing a model's dtype]).
  bool convert_dtype = false;
};

namespace detail {

CHORUS_INLINE std::string join(const std::vector<std::string>& v);

/// A prefix p (ending in '.') such that the source's names are exactly p + the module's names,
/// or the other way round; empty when there is none. `from` is the side that has the prefix.
CHORUS_INLINE std::string common_prefix(const std::set<std::string>& from, const std::set<std::string>& to);

/// One tensor of a load's source: its dtype and shape, and how to write its values into the
/// module's tensor (already checked to have its shape, and its dtype unless converting);
/// `write` returns false when there was nothing to write (the tensor is the source itself).
struct Source {
  DType dtype;
  Shape shape;
  std::function<bool(AnyTensor&)> write;
};

/// The words a load's messages use for its source.
struct SourceWords {
  std::string what;  ///< e.g. "'ckpt.safetensors'", "the source module"
  std::string noun;  ///< e.g. "the file", "the source module"
};

/// Matches `sources` (keyed by their own names) to `module`'s parameters and buffers, checks
/// that every tensor of each side is matched with the same shape and dtype (or a convertible
/// one, when options.convert_dtype), and only then writes. A failure while writing says that
/// the module may be partly loaded.
CHORUS_INLINE void load_named(nn::Module& module, const std::vector<std::pair<std::string, Source>>& sources,
                              const SourceWords& words, const LoadOptions& options);

/// What nn::module_of accepts: a Module, a holder, a std::shared_ptr to a Module, or a wrapper
/// with module() (DataParallel).
template <class M>
concept module_like =
    std::is_base_of_v<nn::Module, M> || requires { typename M::ImplType; } ||
    (requires { typename M::element_type; } && std::is_base_of_v<nn::Module, std::remove_cv_t<typename M::element_type>>) ||
    requires(const M& m) { m.module(); };

}  // namespace detail
}  // namespace io

/// Copies another module's parameters and buffers into `module`, matched by dotted name as a
/// checkpoint is (every tensor of each side matched, shapes equal); a dtype change only with
/// `.convert_dtype = true` (Note [changing a model's dtype]: how chorus changes a model's
/// dtype). Either side may be a holder, an Impl or a DataParallel (its wrapped module), and
/// the two may live on different devices. Everything is checked before the first value is
/// written; a module loaded from itself is left as it is.
template <class M, class S>
  requires io::detail::module_like<M> && io::detail::module_like<S>
void load(M& module, const S& source, const io::LoadOptions& options = {}) {
  const nn::Module& src = nn::module_of(source);
  std::vector<std::pair<std::string, io::detail::Source>> sources;
  for (auto& t : src.named_tensors()) {
    io::detail::Source s{t.tensor.dtype(), t.tensor.shape(), nullptr};
    s.write = [from = t.tensor](AnyTensor& dst) {
      bool wrote = true;
      dst.visit([&](auto& x) {
        using T = typename std::decay_t<decltype(x)>::value_type;
        from.visit([&](const auto& y) {
          using F = typename std::decay_t<decltype(y)>::value_type;
          if constexpr (std::is_same_v<T, F>) {
            if (x.same_storage(y) && x.storage_offset() == y.storage_offset() && x.strides() == y.strides()) {
              wrote = false;  // the module's own tensor
              return;
            }
            backend::copy(x, y.device() == x.device() ? y : y.to(x.device()));
          } else if constexpr (is_floating_v<T> && is_floating_v<F>) {  // checked: convert_dtype asked
            backend::copy(x, y.template to<T>().to(x.device()));
          }
        });
      });
      return wrote;
    };
    sources.emplace_back(std::move(t.name), std::move(s));
  }
  const std::string kind = src.name() == "Module" ? std::string() : " (" + src.name() + ")";
  io::detail::load_named(nn::module_of(module), sources, {"the source module" + kind, "the source module"}, options);
}

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "state_impl.hpp"
#endif
