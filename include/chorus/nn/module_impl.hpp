#pragma once
// The definitions of nn/module.hpp (nn::Module's registry walks, device moves and printing,
// DeviceCopyScope): compiled into chorus::compiled (src/nn/module.cpp), included by module.hpp
// itself in the header-only form (Note [compiled chorus] in compiled.hpp).
#include <functional>
#include <unordered_set>

#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

namespace detail {
CHORUS_INLINE void check_name(const std::string& name, const char* what) {
  CHORUS_CHECK(!name.empty(), what, " name must not be empty");
  CHORUS_CHECK(name.find('.') == std::string::npos, what, " name '", name, "' must not contain '.'");
}
}  // namespace detail

CHORUS_INLINE Module::~Module() = default;

template <class T>
Tensor<T> Module::register_parameter(std::string name, Tensor<T> tensor, bool requires_grad) {
  detail::check_name(name, "parameter");
  CHORUS_CHECK(tensor.defined(), "register_parameter('", name, "'): undefined tensor");
  CHORUS_CHECK(tensor.is_leaf(), "register_parameter('", name, "'): a parameter must be a leaf tensor (detach it)");
  check_unique(name);
  if constexpr (is_floating_v<T>) tensor.requires_grad_(requires_grad);
  params_.push_back({std::move(name), tensor, {}});
  return tensor;
}

template <class T>
Tensor<T> Module::register_buffer(std::string name, Tensor<T> tensor) {
  detail::check_name(name, "buffer");
  CHORUS_CHECK(tensor.defined(), "register_buffer('", name, "'): undefined tensor");
  check_unique(name);
  buffers_.push_back({std::move(name), tensor, {}});
  return tensor;
}

CHORUS_INLINE Module::Module(const Module& other)
    : params_(other.params_), buffers_(other.buffers_), training_(other.training_) {
  // A member slot's tensor is the derived class's member, copied by its copy constructor.
  children_.reserve(other.children_.size());
  for (const auto& c : other.children_)
    children_.push_back({c.name, detail::map_module(c.module, c.clone), c.clone});
}

CHORUS_INLINE Module& Module::operator=(const Module& other) {
  if (this != &other) {
    Module tmp(other);
    *this = std::move(tmp);
  }
  return *this;
}

CHORUS_INLINE std::vector<AnyTensor> Module::parameters(bool recurse) const {
  std::vector<AnyTensor> out;
  for (auto& p : named_parameters(recurse)) out.push_back(std::move(p.tensor));
  return out;
}

namespace detail {
CHORUS_INLINE std::vector<Module::NamedTensor> without_duplicates(std::vector<Module::NamedTensor> named) {
  std::unordered_set<const void*> seen;
  std::vector<Module::NamedTensor> out;
  out.reserve(named.size());
  for (auto& t : named)
    if (seen.insert(t.tensor.impl_key()).second) out.push_back(std::move(t));
  return out;
}
}  // namespace detail

CHORUS_INLINE std::vector<Module::NamedTensor> Module::named_parameters(bool recurse, bool remove_duplicate) const {
  std::vector<NamedTensor> out;
  collect(out, "", recurse, &Module::params_);
  return remove_duplicate ? detail::without_duplicates(std::move(out)) : out;
}

CHORUS_INLINE std::vector<AnyTensor> Module::buffers(bool recurse) const {
  std::vector<AnyTensor> out;
  for (auto& p : named_buffers(recurse)) out.push_back(std::move(p.tensor));
  return out;
}

CHORUS_INLINE std::vector<Module::NamedTensor> Module::named_buffers(bool recurse, bool remove_duplicate) const {
  std::vector<NamedTensor> out;
  collect(out, "", recurse, &Module::buffers_);
  return remove_duplicate ? detail::without_duplicates(std::move(out)) : out;
}

CHORUS_INLINE std::vector<Module::NamedTensor> Module::named_tensors() const {
  auto out = named_parameters(true, false);
  for (auto& b : named_buffers(true, false)) out.push_back(std::move(b));
  return out;
}

CHORUS_INLINE std::vector<std::shared_ptr<Module>> Module::children() const {
  std::vector<std::shared_ptr<Module>> out;
  for (const auto& c : children_) out.push_back(c.module);
  return out;
}

CHORUS_INLINE void Module::train(bool on) {
  training_ = on;
  for (auto& c : children_) c.module->train(on);
}

CHORUS_INLINE void Module::to(Device device) {
  check_device(device);
  NoGradGuard g;
  std::vector<std::function<void()>> installs;  // no-throw steps, run once every copy exists
  std::unordered_set<const void*> seen;         // a tensor registered twice moves once
  for_each_tensor([&](AnyTensor& t) {
    t.visit([&](auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      if (x.device() == device || !seen.insert(x.impl().get()).second) return;
      auto moved = x.to(device);
      Tensor<T> grad = x.impl()->grad ? Tensor<T>(x.impl()->grad).to(device) : Tensor<T>();
      installs.push_back([impl = x.impl(), moved = std::move(moved), grad = std::move(grad)] {
        impl->storage = moved.impl()->storage;
        impl->offset = moved.storage_offset();
        impl->strides = moved.strides();
        impl->grad = grad.impl();
        impl->grad_accumulator.reset();
      });
    });
  });
  for (auto& install : installs) install();
}

CHORUS_INLINE void Module::zero_grad(bool set_to_none) {
  NoGradGuard g;
  for (auto& p : parameters()) {
    p.visit([&](auto& x) {
      if (!x.grad().defined()) return;
      if (set_to_none) {
        x.set_grad({});
      } else {
        x.grad().zero_();
      }
    });
  }
}

CHORUS_INLINE bool Module::any_meets_other_replicas() const {
  if (meets_other_replicas()) return true;
  for (const auto& c : children_)
    if (c.module->any_meets_other_replicas()) return true;
  return false;
}

CHORUS_INLINE void Module::pretty_print(std::ostream& os, int indent) const {
  os << name() << "(";
  bool any = false;
  for (const auto& p : named_parameters(false, false)) {
    os << "\n" << std::string(indent + 2, ' ') << p.name << ": " << p.tensor.shape() << " "
       << dtype_name(p.tensor.dtype()) << " on " << p.tensor.device();
    any = true;
  }
  for (const auto& c : children_) {
    os << "\n" << std::string(indent + 2, ' ') << "(" << c.name << "): ";
    c.module->pretty_print(os, indent + 2);
    any = true;
  }
  if (any) os << "\n" << std::string(indent, ' ');
  os << ")";
}

CHORUS_INLINE AnyTensor Module::find_tensor(const std::string& dotted) const {
  auto dot = dotted.find('.');
  if (dot == std::string::npos) {
    for (const auto* slots : {&params_, &buffers_})
      for (const auto& s : *slots)
        if (s.name == dotted) return current(s);
    return {};
  }
  const std::string head = dotted.substr(0, dot);
  for (const auto& c : children_)
    if (c.name == head) return c.module->find_tensor(dotted.substr(dot + 1));
  return {};
}

CHORUS_INLINE AnyTensor Module::current(const Slot& slot) const {
  if (slot.member.index() == 0) return slot.tensor;
  return std::visit(
      [&](auto member) -> AnyTensor {
        if constexpr (std::is_same_v<decltype(member), std::monostate>) {
          return {};
        } else {
          const auto& t = this->*member;
          return t.defined() ? AnyTensor(t) : AnyTensor();
        }
      },
      slot.member);
}

CHORUS_INLINE void Module::check_unique(const std::string& name) const {
  for (const auto& p : params_) CHORUS_CHECK(p.name != name, "'", name, "' is already registered as a parameter");
  for (const auto& b : buffers_) CHORUS_CHECK(b.name != name, "'", name, "' is already registered as a buffer");
  for (const auto& c : children_) CHORUS_CHECK(c.name != name, "'", name, "' is already registered as a submodule");
}

CHORUS_INLINE void Module::collect(std::vector<NamedTensor>& out, const std::string& prefix, bool recurse,
                                   std::vector<Slot> Module::*which) const {
  for (const auto& s : this->*which)
    if (AnyTensor t = current(s); t.defined()) out.push_back({prefix + s.name, std::move(t)});
  if (!recurse) return;
  for (const auto& c : children_) c.module->collect(out, prefix + c.name + ".", true, which);
}

namespace detail {

CHORUS_INLINE std::shared_ptr<void> DeviceCopyScope::copy_tensor(const void* impl, DType dtype) {
  return visit_dtype(dtype, [&](auto tag) -> std::shared_ptr<void> {
    return deep_copy(*static_cast<const TensorImpl<decltype(tag)>*>(impl), device_);
  });
}

CHORUS_INLINE std::vector<const void*> registered_keys(const Module& root) {
  std::vector<const void*> keys;
  for (const auto& t : root.named_tensors()) keys.push_back(t.tensor.impl_key());
  return keys;
}

CHORUS_INLINE void check_registry_unchanged(const Module& root, const std::vector<const void*>& keys, const char* who) {
  const auto named = root.named_tensors();
  for (std::size_t k = 0; k < std::max(named.size(), keys.size()); ++k) {
    if (k < named.size() && k < keys.size() && named[k].tensor.impl_key() == keys[k]) continue;
    const std::string what = k < named.size() ? "'" + named[k].name + "'" : std::string("a registered tensor");
    CHORUS_FAIL(who, ": ", what, " is not the tensor it was when the ", who,
                " was built (a member assigned or tied afterwards?); tie or replace parameters before building the ",
                who, ", or build a new one");
  }
}

CHORUS_INLINE void walk(const Module& m, const std::string& prefix,
                        std::vector<std::pair<std::string, const std::shared_ptr<Module>*>>& out) {
  for (const auto& c : m.named_children()) {
    out.push_back({prefix + c.name, &c.module});
    walk(*c.module, prefix + c.name + ".", out);
  }
}

}  // namespace detail
}  // namespace nn
CHORUS_NAMESPACE_END
