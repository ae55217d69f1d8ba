// partition.cc: even cuts and the checks every balance must pass.
#include "gpipe/partition.h"

#include "gpipe/check.h"

#include <numeric>
#include <sstream>

namespace gpipe {

namespace {
std::string show(const std::vector<int>& balance) {
  std::ostringstream out;
  out << '{';
  for (size_t j = 0; j < balance.size(); ++j) out << (j ? ", " : "") << balance[j];
  out << '}';
  return out.str();
}
}  // namespace

std::vector<int> even_balance(int layers, int stages) {
  GPIPE_CHECK(layers >= 1, "the model is empty (0 layers); give the pipeline a torch::nn::Sequential "
              "with at least one layer");
  GPIPE_CHECK(stages >= 1, "the number of stages must be at least 1 (got ", stages, ")");
  GPIPE_CHECK(stages <= layers, "cannot cut ", layers, " layers into ", stages,
              " stages: every stage needs at least one layer; use at most ", layers, " stages");
  std::vector<int> balance(static_cast<size_t>(stages), layers / stages);
  for (int j = 0; j < layers % stages; ++j) balance[static_cast<size_t>(j)] += 1;
  return balance;
}

void check_balance(const std::vector<int>& balance, int layers) {
  GPIPE_CHECK(!balance.empty(), "the balance is empty; give the number of layers of each stage, "
              "e.g. {", layers - layers / 2, ", ", layers / 2, "}, or set stages instead");
  for (size_t j = 0; j < balance.size(); ++j)
    GPIPE_CHECK(balance[j] >= 1, "stage ", j, " of balance ", show(balance), " has ", balance[j],
                " layers; every stage needs at least one layer");
  const int sum = std::accumulate(balance.begin(), balance.end(), 0);
  GPIPE_CHECK(sum == layers, "the model and the sum of the balance differ (model: ", layers,
              " layers, sum of balance ", show(balance), ": ", sum,
              "); make the balance add up to ", layers, " or set stages to split evenly");
}

std::vector<int> stage_offsets(const std::vector<int>& balance) {
  std::vector<int> offsets{0};
  for (int n : balance) offsets.push_back(offsets.back() + n);
  return offsets;
}

}  // namespace gpipe
