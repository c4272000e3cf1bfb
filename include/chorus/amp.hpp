#pragma once
// chorus's automatic mixed precision (torch.amp): amp::GradScaler. Included on its own (it is
// not part of <chorus/chorus.hpp>, as torch.amp is a module of its own).
#include "amp/grad_scaler.hpp"
