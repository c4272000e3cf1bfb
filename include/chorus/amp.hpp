#pragma once
// chorus's mixed precision (torch.amp): amp::GradScaler and amp::MasterWeights (Note [the form
// of mixed precision]). Part of <chorus/chorus.hpp> (optimizer checkpoints hold their state).
#include "amp/grad_scaler.hpp"
#include "amp/master_weights.hpp"
