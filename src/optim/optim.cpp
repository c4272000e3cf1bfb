// chorus::compiled: the optimizers of optim/ (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/optim/optimizer_impl.hpp>
#include <chorus/optim/sgd_impl.hpp>
#include <chorus/optim/adam_impl.hpp>

CHORUS_NAMESPACE_BEGIN
namespace optim {
// The option holders and AdamBase, for chorus's own option structs (their extern template
// declarations are in sgd.hpp and adam.hpp).
template class detail::GroupedOptimizer<SGDOptions>;
template class detail::GroupedOptimizer<AdamOptions>;
template class detail::GroupedOptimizer<AdamWOptions>;
template class detail::AdamBase<AdamOptions>;
template class detail::AdamBase<AdamWOptions>;
}  // namespace optim
CHORUS_NAMESPACE_END
