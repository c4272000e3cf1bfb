// chorus::compiled: DataParallel's part that does not depend on the module's type (Note
// [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/parallel/data_parallel_core_impl.hpp>
