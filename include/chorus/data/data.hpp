#pragma once
// Datasets and the DataLoader.
#include "dataloader.hpp"
#include "dataset.hpp"
