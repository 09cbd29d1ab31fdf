#pragma once
// The layout of the row_stats that the cross-entropy forwards save for their
// backwards: what the argument checks (cross_entropy_checks.h) and the shared
// algorithm (cross_entropy_statistics.h) both read.

#include <cstdint>

namespace shardtorch {
namespace ops {

// The row_stats a forward saves for its backward: float64 [rows + 1,
// kNumSavedStats], one row per input row and a trailer. A probability target
// (probability_target.h) keeps the same columns: its row's target weight is
// A_i = sum_c w_c p_ic, every row counts, and mean divides by the rows.
enum SavedStat : int64_t {
  kSavedLse = 0,           // log-sum-exp over all classes
  kSavedTargetWeight = 1,  // w[target] (1 without class weights, 0 when ignored);
                           // probabilities: sum_c w_c p_c
  kSavedValid = 2,         // 1 unless the target is ignore_index (probabilities: 1)
  kSavedRowLoss = 3,       // the row's unreduced loss
  kNumSavedStats = 4,
};
// Columns of the trailer (the last row).
enum SavedTrailer : int64_t {
  kTrailerClasses = 0,      // num_classes
  kTrailerOffset = 1,       // this rank's first class
  kTrailerWeightSum = 2,    // sum of the class weights over all classes
  kTrailerDenominator = 3,  // reduction mean's divisor (probabilities: the rows, as torch)
};

}  // namespace ops
}  // namespace shardtorch
