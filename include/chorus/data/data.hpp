#pragma once
// Datasets and the DataLoader.
#include "dataloader.hpp"
#include "dataset.hpp"
#include "pinned.hpp"
#include "transforms.hpp"
#include "vision.hpp"
