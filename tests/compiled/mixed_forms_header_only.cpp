// One half of a program that mixes the two forms of chorus (test compiled_mixed_forms_fail_to_link):
// this unit is header-only, its caller (mixed_forms_compiled.cpp) is of the compiled form. The
// two see different inline ABI namespaces (Note [compiled chorus]), so the call cannot link.
#undef CHORUS_COMPILED
#define CHORUS_COMPILED 0
#include <chorus/chorus.hpp>

float first_value(const chorus::Tensor<float>& t) { return t.to_vector().at(0); }
