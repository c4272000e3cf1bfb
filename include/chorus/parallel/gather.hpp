#pragma once
// gather: per-device outputs joined along a dimension on one device (differentiable; its
// backward sends each device its slice of the gradient).
#include <vector>

#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

template <class T>
class GatherBackward final : public autograd::Node<T> {
 public:
  GatherBackward(int dim, std::vector<std::int64_t> sizes, std::vector<Device> devices, bool stacked)
      : dim_(dim), sizes_(std::move(sizes)), devices_(std::move(devices)), stacked_(stacked) {}
  std::string name() const override { return "GatherBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    typename autograd::Node<T>::TensorList out;
    std::int64_t start = 0;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      if (!this->next_edges()[i].valid()) {
        out.emplace_back();
      } else {
        Tensor<T> part = g[0].narrow(dim_, start, sizes_[i]);
        if (stacked_) part = ops::detail::view_as_shape(ops::detail::contiguous_data(part), Shape{});
        auto moved = Tensor<T>::empty(part.shape(), devices_[i]);
        backend::copy(moved, part);
        out.push_back(std::move(moved));
      }
      start += sizes_[i];
    }
    return out;
  }

 private:
  int dim_;
  std::vector<std::int64_t> sizes_;
  std::vector<Device> devices_;
  bool stacked_;
};

}  // namespace detail

/// Joins `parts` (one per device, equal shapes but for `dim`) along `dim` on `device`.
/// 0-dim parts (a per-replica loss, say) are stacked into a vector, as torch's Gather does.
template <class T>
Tensor<T> gather(const std::vector<Tensor<T>>& parts, std::int64_t dim, Device device) {
  CHORUS_CHECK(!parts.empty(), "gather: no tensors");
  for (std::size_t i = 0; i < parts.size(); ++i)
    CHORUS_CHECK(parts[i].defined(), "gather: output of replica ", i, " is an undefined tensor");
  const bool stacked = parts[0].dim() == 0;
  const int d = stacked ? 0 : wrap_dim(dim, parts[0].dim());
  Shape shape = stacked ? Shape{0} : parts[0].shape();
  shape[d] = 0;
  std::vector<std::int64_t> sizes;
  std::vector<Device> devices;
  bool grad = false;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    bool ok = p.dim() == parts[0].dim();
    for (int k = 0; ok && k < p.dim(); ++k) ok = k == d || p.shape()[k] == parts[0].shape()[k];
    CHORUS_CHECK(ok, "gather: output of replica ", i, " has shape ", p.shape(), ", incompatible with replica 0's ",
                 parts[0].shape(), " along dimension ", d);
    const std::int64_t n = stacked ? 1 : p.shape()[d];
    shape[d] += n;
    sizes.push_back(n);
    devices.push_back(p.device());
    grad = grad || p.requires_grad();
  }
  auto out = Tensor<T>::empty(shape, device);
  std::int64_t start = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    auto slot = out.detach().narrow(d, start, sizes[i]);
    backend::copy(slot, stacked ? ops::detail::view_as_shape(parts[i].detach().contiguous(), Shape{1}) : parts[i]);
    start += sizes[i];
  }
  if (grad && autograd::is_grad_enabled()) {
    auto node = std::make_shared<detail::GatherBackward<T>>(d, sizes, devices, stacked);
    for (const auto& p : parts) node->add_next_edge(autograd::gradient_edge(p));
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

}  // namespace parallel
CHORUS_NAMESPACE_END
