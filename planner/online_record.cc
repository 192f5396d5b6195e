// The online planner's decision record (planner/online.h Decision): its
// YAML (the daemon's RUN_DIR/plan.yaml, `bytecomp-plan explain`) and the
// human table. decide() itself is in online.cc.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "common/config.h"
#include "planner/online.h"
#include "planner/strategy/profile.h"

namespace bytecomp::planner::online {

using config::Document;
using config::Range;
using config::Reader;
using strategy::emit_text;

namespace {

std::string fmt_fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace

std::string Decision::to_yaml() const {
  YAML::Emitter out;
  out.SetDoublePrecision(17);
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << 1;
  out << YAML::Key << "predicted_us" << YAML::Value << predicted_us;
  out << YAML::Key << "measured_us" << YAML::Value << measured_us;
  out << YAML::Key << "decision_ms" << YAML::Value << decision_ms;
  if (!kept_current.empty())
    out << YAML::Key << "kept_current" << YAML::Value << YAML::DoubleQuoted << kept_current;
  out << YAML::Key << "tensors" << YAML::Value << YAML::BeginSeq;
  for (const TensorChoice& t : tensors) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "name" << YAML::Value
        << YAML::DoubleQuoted << t.name << YAML::Key << "bytes" << YAML::Value << t.bytes
        << YAML::Key << "option" << YAML::Value << YAML::DoubleQuoted << t.option << YAML::Key
        << "excluded" << YAML::Value << t.excluded;
    if (!t.guard.empty()) out << YAML::Key << "guard" << YAML::Value << YAML::DoubleQuoted << t.guard;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::Key << "alternatives" << YAML::Value << YAML::BeginSeq;
  for (const Alternative& a : alternatives) {
    out << YAML::BeginMap << YAML::Key << "name" << YAML::Value << YAML::DoubleQuoted << a.name
        << YAML::Key << "predicted_us" << YAML::Value << a.predicted_us;
    emit_text(out, "strategy", a.strategy_yaml);
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  emit_text(out, "strategy", strategy.to_yaml());
  emit_text(out, "timeline_json", timeline_json);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

Decision Decision::parse(std::string_view text, std::string name) {
  Document doc = Document::parse(text, name);
  Reader root = doc.root("");
  Decision d;
  root.require("predicted_us").require("strategy").require("tensors");
  std::string strategy_text;
  root.get("predicted_us", d.predicted_us, Range<double>{0, 1e15})
      .get("measured_us", d.measured_us, Range<double>{0, 1e15})
      .get("decision_ms", d.decision_ms, Range<double>{0, 1e12})
      .get("kept_current", d.kept_current)
      .get("strategy", strategy_text)
      .get("timeline_json", d.timeline_json);
  for (Reader& r : root.list("tensors")) {
    TensorChoice t;
    r.require("name").require("option");
    r.get("name", t.name).get("bytes", t.bytes).get("option", t.option).get("excluded", t.excluded).get("guard", t.guard);
    if (t.name.empty()) r.fail("name", "empty tensor name");
    r.finish();
    d.tensors.push_back(std::move(t));
  }
  for (Reader& r : root.list("alternatives")) {
    Alternative a;
    r.require("name").require("predicted_us");
    r.get("name", a.name)
        .get("predicted_us", a.predicted_us, Range<double>{0, 1e15})
        .get("strategy", a.strategy_yaml);
    if (!a.strategy_yaml.empty()) {
      try {
        (void)Strategy::parse(a.strategy_yaml, name + ": alternative '" + a.name + "' strategy");
      } catch (const std::exception& e) {
        r.fail("strategy", e.what());
      }
    }
    r.finish();
    d.alternatives.push_back(std::move(a));
  }
  root.finish();
  d.strategy = Strategy::parse(strategy_text, name + ": strategy");
  return d;
}

std::string Decision::explain() const {
  std::ostringstream os;
  size_t w = 6;
  for (const TensorChoice& t : tensors) w = std::max(w, t.name.size());
  int compressed = 0;
  uint64_t total = 0, squeezed = 0;
  for (const TensorChoice& t : tensors) {
    total += t.bytes;
    if (t.option.rfind("none", 0) != 0) {
      ++compressed;
      squeezed += t.bytes;
    }
  }
  os << "Decision: " << compressed << " of " << tensors.size() << " tensors compressed ("
     << fmt_fixed(total ? 100.0 * static_cast<double>(squeezed) / static_cast<double>(total) : 0, 1)
     << "% of the bytes)\n";
  auto meta_of = [&](const char* k) {
    auto it = strategy.meta.find(k);
    return it == strategy.meta.end() ? std::string() : it->second;
  };
  if (std::string link = meta_of("calibration.link_gbps"); !link.empty())
    os << "model: link " << link << " Gbit/s, " << meta_of("calibration.link_source")
       << "; residual " << meta_of("calibration.residual_us") << " us, scale "
       << meta_of("calibration.scale") << "\n";
  // The option's first word is the compressor and its parameters; the rest
  // (scheme, collectives) is the same shape for every tensor of a placement
  // and is in plan.yaml; tensors on the daemons' ring are marked.
  os << "\n" << "tensor" << std::string(w - 6 + 2, ' ') << "      bytes  choice\n";
  for (const TensorChoice& t : tensors) {
    const std::string b = std::to_string(t.bytes);
    std::string what = t.option.substr(0, t.option.find(' '));
    if (t.option.find(" ef ") != std::string::npos) what += " +ef";
    if (t.option.find("inter=allreduce") != std::string::npos) what += " on the ring";
    os << t.name << std::string(w - t.name.size() + 2, ' ')
       << std::string(b.size() < 11 ? 11 - b.size() : 0, ' ') << b << "  " << what
       << (t.excluded ? "  (excluded)" : "") << (t.guard.empty() ? "" : "  (" + t.guard + ")")
       << "\n";
  }
  if (std::string why = meta_of("kept_uncompressed"); !why.empty())
    os << "\nkept uncompressed: " << why << "\n";
  if (!kept_current.empty()) os << "\nhysteresis: " << kept_current << "\n";
  if (std::string why = meta_of("placement_moves"); !why.empty())
    os << "\nplacement: " << why << "\n";
  os << "\npredicted iteration: " << fmt_fixed(predicted_us / 1e3, 2) << " ms\n";
  os << "measured before the decision: " << fmt_fixed(measured_us / 1e3, 2) << " ms\n";
  if (!alternatives.empty()) {
    os << "\nalternatives (predicted):\n";
    size_t aw = 4;
    for (const Alternative& a : alternatives) aw = std::max(aw, a.name.size());
    for (const Alternative& a : alternatives)
      os << "  " << a.name << std::string(aw - a.name.size() + 2, ' ')
         << fmt_fixed(a.predicted_us / 1e3, 2) << " ms\n";
  }
  return os.str();
}

}  // namespace bytecomp::planner::online
