// chorus::compiled: the oneDNN convolutions of backend/cpu/ (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/backend/cpu/onednn_impl.hpp>
