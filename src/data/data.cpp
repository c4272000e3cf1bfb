// chorus::compiled: batching and pinning of data/ (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_DATA_DATASET_INSTANCES, CHORUS_ALL_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_DATA_PINNED_INSTANCES, CHORUS_ALL_DTYPES)
