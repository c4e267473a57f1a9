// Which rows each expert runs: rows whose token is real (tok_R[r] < T), grouped by expert.
#pragma once

#include <cstdint>
#include <vector>

namespace mjn {

struct ExpertRows {
  std::vector<int64_t> start;  // [E + 1]: expert e's rows are rows[start[e] : start[e + 1]]
  std::vector<int32_t> rows;   // buffer rows, in buffer order within each expert
};

// A counting sort of the buffer's live rows by expert; rows of an expert id outside [0, E)
// are skipped (the caller checks them first).
inline ExpertRows group_rows(const int32_t* tok_R, const int32_t* expert_R, int64_t R, int64_t T,
                             int64_t E) {
  ExpertRows out;
  out.start.assign(E + 1, 0);
  for (int64_t r = 0; r < R; ++r)
    if (tok_R[r] < T) out.start[expert_R[r] + 1]++;
  for (int64_t e = 0; e < E; ++e) out.start[e + 1] += out.start[e];
  out.rows.resize(out.start[E]);
  std::vector<int64_t> fill(out.start.begin(), out.start.end() - 1);
  for (int64_t r = 0; r < R; ++r)
    if (tok_R[r] < T) out.rows[fill[expert_R[r]]++] = int32_t(r);
  return out;
}

// Work items: (expert, first row, end row) in `rows` order, at most `block` rows each.
struct Item {
  int64_t expert, begin, end;
};

inline std::vector<Item> row_blocks(const ExpertRows& er, int64_t block) {
  std::vector<Item> items;
  int64_t E = int64_t(er.start.size()) - 1;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t b = er.start[e]; b < er.start[e + 1]; b += block)
      items.push_back({e, b, std::min(b + block, er.start[e + 1])});
  return items;
}

}  // namespace mjn
