// The other half of the mixed program (see mixed_forms_header_only.cpp): a unit of the compiled
// form calling a function the header-only unit defines.
#include <chorus/chorus.hpp>

float first_value(const chorus::Tensor<float>& t);

int main() { return first_value(chorus::ones<float>({1})) == 1.0f ? 0 : 1; }
