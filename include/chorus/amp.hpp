#pragma once
// chorus's mixed precision (torch.amp): amp::GradScaler and amp::MasterWeights (Note [the form
// of mixed precision]). Included on its own (it is not part of <chorus/chorus.hpp>, as torch.amp
// is a module of its own).
#include "amp/grad_scaler.hpp"
#include "amp/master_weights.hpp"
