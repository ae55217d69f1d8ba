// partition.h: how a model's L layers are cut into K consecutive stages (a "balance").
#pragma once

#include <vector>

namespace gpipe {

/// Layers per stage for an even cut of `layers` layers into `stages` stages:
/// the first `layers % stages` stages take one layer more.
///
///   even_balance(10, 3) == {4, 3, 3}
std::vector<int> even_balance(int layers, int stages);

/// Throws std::invalid_argument unless `balance` is a valid cut of `layers`
/// layers: non-empty, every entry at least 1, summing to `layers`.
void check_balance(const std::vector<int>& balance, int layers);

/// Index of the first layer of each stage, plus `layers` at the end:
/// offsets({4, 3, 3}) == {0, 4, 7, 10}.
std::vector<int> stage_offsets(const std::vector<int>& balance);

}  // namespace gpipe
