#pragma once
// The two forms of chorus: header-only (chorus::chorus) and compiled (chorus::compiled).
//
// Note [compiled chorus]
// chorus's operators, kernels, layers and autograd nodes are templates over the element type,
// and header-only every translation unit instantiates and optimises all of them again for each
// dtype it touches: most of a test's or a training program's compile time goes there, not to
// its own code. chorus::compiled is the static library that holds them compiled once, for the
// dtypes chorus supports (float, double, bfloat16, half and int64 where an operation takes
// it); a translation unit that links it gets CHORUS_COMPILED=1, which
//  - declares every instance listed below `extern template`: each header ends with its list
//    (CHORUS_<AREA>_INSTANCES) and `CHORUS_EXTERN_INSTANCES(list, dtypes)`, so the unit
//    instantiates none of them and calls the library's copies; src/<area>/*.cpp define them
//    from the same lists (CHORUS_DEFINE_INSTANCES), so a list and the library cannot disagree;
//  - puts everything into another inline ABI namespace (v0_1_cpu_dnnl_compiled, Note [ABI
//    namespace] in config.hpp): a program that mixes the two forms links two distinct copies
//    or fails to link where a symbol crosses between them, never an ODR violation.
// An instance missing from a list is instantiated by the unit itself, as header-only code
// does: slower to compile, never wrong. Templates over a user's types (DataParallel<Model>,
// DataLoader<Dataset>, the module holders' forwarding) stay in the headers, as they must.
// `extern template` does not stop GCC from instantiating an inline member (one defined in its
// class) to inline it, so the class instances below save the out-of-line copies and, above
// all, what those members call; the free functions and the Tensor members defined in ops/ are
// not inline and are never instantiated by a unit that sees their list.
//
// Non-template code the library holds is declared CHORUS_INLINE in its header and defined in a
// <name>_impl.hpp beside it, which the header includes only in the header-only form and
// src/<area>/<name>.cpp compiles into the library: a unit of the compiled form neither parses
// nor compiles it. That holds nn::Module's registry, the optimizers and schedulers, the
// runtime, DataParallel's type-independent part (DataParallelCore), the replicator and the
// communicators, the data readers and the checkpoint formats (io/safetensors_impl.hpp keeps
// nlohmann::json out of such units): a user's unit compiles its own code and the templates
// over its own types. A template whose every possible instance is listed may keep its
// definition in an _impl.hpp too (autograd/engine_impl.hpp: backward() takes the four
// floating dtypes, all listed); there a missing instance would be a link error, so only
// complete lists qualify. A virtual function defined in an _impl.hpp is declared CHORUS_INLINE
// in its class: declared plainly it would be the class's key function, and once defined
// `inline` every header-only unit would emit the vtable and all the virtual functions (test
// compiled_library_code_stays_in_the_library). The distributed layer's part over MPI is the
// separate static library chorus_distributed_compiled, linked through chorus::distributed.
//
// Each list is L(X, T): X(declaration) for one dtype T, the declaration written as an explicit
// instantiation takes it (template arguments explicit, no default arguments).
#include "config.hpp"

#ifndef CHORUS_COMPILED
#define CHORUS_COMPILED 0
#endif

#if CHORUS_COMPILED
#define CHORUS_INLINE
#else
#define CHORUS_INLINE inline
#endif

#define CHORUS_EXTERN_INSTANCE(...) extern template __VA_ARGS__;
#define CHORUS_DEFINE_INSTANCE(...) template __VA_ARGS__;

// Dtype groups: G(L, X) applies list L to X for each dtype of the group.
#define CHORUS_FLOATING_DTYPES(L, X) L(X, float) L(X, double) L(X, bfloat16) L(X, half)
#define CHORUS_ALL_DTYPES(L, X) CHORUS_FLOATING_DTYPES(L, X) L(X, std::int64_t)
#define CHORUS_INT_DTYPES(L, X) L(X, std::int64_t)

#if CHORUS_COMPILED
#define CHORUS_EXTERN_INSTANCES(L, G) CHORUS_NAMESPACE_BEGIN G(L, CHORUS_EXTERN_INSTANCE) CHORUS_NAMESPACE_END
#else
#define CHORUS_EXTERN_INSTANCES(L, G)
#endif
#define CHORUS_DEFINE_INSTANCES(L, G) CHORUS_NAMESPACE_BEGIN G(L, CHORUS_DEFINE_INSTANCE) CHORUS_NAMESPACE_END
