// chorus::compiled: the device runtime's checks and slow paths, the host engine, and the random
// generator's fills, seeding, state and replica bookkeeping (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/core/generator_impl.hpp>
#include <chorus/core/host_engine_impl.hpp>
#include <chorus/core/runtime_impl.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_CORE_GENERATOR_INSTANCES, CHORUS_ALL_DTYPES)
