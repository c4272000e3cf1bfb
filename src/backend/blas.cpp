// chorus::compiled: oneDNN's bfloat16 matmul and the GEMM route of backend/cpu/blas.hpp (Note
// [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/backend/cpu/blas_impl.hpp>
