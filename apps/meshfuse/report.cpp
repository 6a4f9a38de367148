#include "report.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>

namespace meshfuse::cli {
namespace {

using nlohmann::json;

json optional_json(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

json to_json(const Record& r) {
  return {{"op", r.op},
          {"direction", r.direction},
          {"backend", r.backend},
          {"device", r.device},
          {"dtype", r.dtype},
          {"shape", r.shape},
          {"median_ms", optional_json(r.median_ms)},
          {"p20_ms", optional_json(r.p20_ms)},
          {"p80_ms", optional_json(r.p80_ms)},
          {"gbps", optional_json(r.gbps)},
          {"tflops", optional_json(r.tflops)},
          {"fraction_of_peak", optional_json(r.fraction_of_peak)},
          {"max_abs_err", optional_json(r.max_abs_err)},
          {"max_rel_err", optional_json(r.max_rel_err)},
          {"status", r.pass ? "pass" : "fail"},
          {"calls", r.calls},
          {"notes", r.notes}};
}

std::string csv_field(const json& v) {
  if (v.is_null()) return "";
  if (v.is_array()) {
    std::string joined;
    for (const json& item : v) joined += (joined.empty() ? "" : "; ") + item.get<std::string>();
    return csv_field(joined);
  }
  if (!v.is_string()) return v.dump();
  std::string s = v.get<std::string>();
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string quoted = "\"";
  for (char c : s) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

std::string number(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : "-";
}

// Display width of UTF-8 text (the byte formulas use '·').
std::size_t width(const std::string& s) {
  return static_cast<std::size_t>(
      std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
}

}  // namespace

const std::vector<std::string>& record_columns() {
  static const std::vector<std::string> columns = {
      "op",          "direction",   "backend", "device", "dtype",  "shape",
      "median_ms",   "p20_ms",      "p80_ms",  "gbps",   "tflops", "fraction_of_peak",
      "max_abs_err", "max_rel_err", "status",  "calls",  "notes"};
  return columns;
}

void print_csv(std::ostream& out, const std::vector<Record>& records) {
  const auto& columns = record_columns();
  for (std::size_t c = 0; c < columns.size(); ++c) out << (c ? "," : "") << columns[c];
  out << '\n';
  for (const Record& r : records) {
    const json j = to_json(r);
    for (std::size_t c = 0; c < columns.size(); ++c)
      out << (c ? "," : "") << csv_field(j[columns[c]]);
    out << '\n';
  }
}

void print_json(std::ostream& out, const std::vector<Record>& records) {
  json list = json::array();
  for (const Record& r : records) list.push_back(to_json(r));
  // Keys in record_columns() order rather than nlohmann's alphabetical one, for readers.
  out << "[";
  for (std::size_t i = 0; i < records.size(); ++i) {
    out << (i ? ",\n " : "\n ") << "{";
    const auto& columns = record_columns();
    for (std::size_t c = 0; c < columns.size(); ++c)
      out << (c ? ", " : "") << json(columns[c]).dump() << ": " << list[i][columns[c]].dump();
    out << "}";
  }
  out << "\n]\n";
}

void print_table(std::ostream& out, const std::vector<std::string>& header,
                 const std::vector<Record>& records) {
  for (const std::string& line : header) out << line << '\n';
  out << '\n';
  // Each record's notes become one numbered footnote.
  std::vector<std::string> footnotes;
  std::vector<std::vector<std::string>> rows = {{"op", "direction", "shape", "backend", "median ms",
                                                 "p20-p80 ms", "GB/s", "TFLOP/s", "of peak",
                                                 "max abs err", "max rel err", "check", "notes"}};
  for (const Record& r : records) {
    std::string mark;
    if (!r.notes.empty()) {
      footnotes.push_back(fmt::format("{} {}: {}", r.op, r.direction, fmt::join(r.notes, "; ")));
      mark = fmt::format("[{}]", footnotes.size());
    }
    rows.push_back({r.op, r.direction, r.shape, r.backend, number(r.median_ms, "{:.3f}"),
                    r.p20_ms ? fmt::format("{:.3f}-{:.3f}", *r.p20_ms, *r.p80_ms) : "-",
                    number(r.gbps, "{:.1f}"), number(r.tflops, "{:.3f}"),
                    r.fraction_of_peak ? fmt::format("{:.0f}%", *r.fraction_of_peak * 100) : "-",
                    number(r.max_abs_err, "{:.2e}"), number(r.max_rel_err, "{:.2e}"),
                    r.pass ? "pass" : "FAIL", mark});
  }
  std::vector<std::size_t> widths(rows[0].size(), 0);
  for (const auto& row : rows)
    for (std::size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], width(row[c]));
  // Text columns left-aligned, numbers right-aligned.
  const auto numeric = [](std::size_t c) { return c >= 4 && c <= 10; };
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t c = 0; c < row.size(); ++c) {
      const std::string pad(widths[c] - width(row[c]), ' ');
      line += (c ? "  " : "") + (numeric(c) ? pad + row[c] : row[c] + pad);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out << line << '\n';
  }
  if (!footnotes.empty()) out << '\n';
  for (std::size_t i = 0; i < footnotes.size(); ++i)
    out << fmt::format("[{}] {}\n", i + 1, footnotes[i]);
}

}  // namespace meshfuse::cli
