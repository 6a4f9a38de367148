// The bench's results: one record per op and direction, printed as a table, CSV or JSON.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace meshfuse::cli {

struct Record {
  std::string op, direction, backend, device, dtype, shape;
  std::optional<double> median_ms{}, p20_ms{}, p80_ms{};
  std::optional<double> gbps{}, tflops{};    // memory-bound ops / GEMMs
  std::optional<double> fraction_of_peak{};  // of the copy bandwidth, or of BLAS at the same shape
  std::optional<double> max_abs_err{}, max_rel_err{};
  bool pass = false;
  int calls = 0;                     // timed calls behind the median
  std::vector<std::string> notes{};  // byte formula, cache, rows checked, failures
};

// The columns of the JSON records and of the CSV header, in order.
const std::vector<std::string>& record_columns();

// Human-readable: the header lines (what the run measured), an aligned table, then the notes as
// numbered footnotes.
void print_table(std::ostream& out, const std::vector<std::string>& header,
                 const std::vector<Record>& records);
// One header line (record_columns()), then one line per record; notes joined with "; ".
void print_csv(std::ostream& out, const std::vector<Record>& records);
// A JSON list of objects with record_columns() as keys (null where not applicable).
void print_json(std::ostream& out, const std::vector<Record>& records);

}  // namespace meshfuse::cli
