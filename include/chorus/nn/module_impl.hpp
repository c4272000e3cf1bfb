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
  params_.push_back({std::move(name), tensor});
  return tensor;
}

template <class T>
Tensor<T> Module::register_buffer(std::string name, Tensor<T> tensor) {
  detail::check_name(name, "buffer");
  CHORUS_CHECK(tensor.defined(), "register_buffer('", name, "'): undefined tensor");
  check_unique(name);
  buffers_.push_back({std::move(name), tensor});
  return tensor;
}

CHORUS_INLINE Module::Module(const Module& other)
    : params_(other.params_), buffers_(other.buffers_), training_(other.training_) {
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

CHORUS_INLINE std::vector<Module::NamedTensor> Module::named_parameters(bool recurse) const {
  std::vector<NamedTensor> out;
  collect(out, "", recurse, &Module::params_);
  return out;
}

CHORUS_INLINE std::vector<AnyTensor> Module::buffers(bool recurse) const {
  std::vector<AnyTensor> out;
  for (auto& p : named_buffers(recurse)) out.push_back(std::move(p.tensor));
  return out;
}

CHORUS_INLINE std::vector<Module::NamedTensor> Module::named_buffers(bool recurse) const {
  std::vector<NamedTensor> out;
  collect(out, "", recurse, &Module::buffers_);
  return out;
}

CHORUS_INLINE std::vector<Module::NamedTensor> Module::named_tensors() const {
  auto out = named_parameters();
  for (auto& b : named_buffers()) out.push_back(std::move(b));
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
  for (const auto& p : params_) {
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

CHORUS_INLINE AnyTensor* Module::find_tensor(const std::string& dotted) {
  auto dot = dotted.find('.');
  if (dot == std::string::npos) {
    for (auto& p : params_)
      if (p.name == dotted) return &p.tensor;
    for (auto& b : buffers_)
      if (b.name == dotted) return &b.tensor;
    return nullptr;
  }
  const std::string head = dotted.substr(0, dot);
  for (auto& c : children_)
    if (c.name == head) return c.module->find_tensor(dotted.substr(dot + 1));
  return nullptr;
}

CHORUS_INLINE void Module::check_unique(const std::string& name) const {
  for (const auto& p : params_) CHORUS_CHECK(p.name != name, "'", name, "' is already registered as a parameter");
  for (const auto& b : buffers_) CHORUS_CHECK(b.name != name, "'", name, "' is already registered as a buffer");
  for (const auto& c : children_) CHORUS_CHECK(c.name != name, "'", name, "' is already registered as a submodule");
}

CHORUS_INLINE void Module::collect(std::vector<NamedTensor>& out, const std::string& prefix, bool recurse,
                                   std::vector<NamedTensor> Module::*which) const {
  for (const auto& p : this->*which) out.push_back({prefix + p.name, p.tensor});
  if (!recurse) return;
  for (const auto& c : children_) c.module->collect(out, prefix + c.name + ".", true, which);
}

namespace detail {

CHORUS_INLINE std::shared_ptr<void> DeviceCopyScope::copy_tensor(const void* impl, DType dtype) {
  return visit_dtype(dtype, [&](auto tag) -> std::shared_ptr<void> {
    return deep_copy(*static_cast<const TensorImpl<decltype(tag)>*>(impl), device_);
  });
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
