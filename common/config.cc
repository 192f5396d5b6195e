#include "common/config.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/record.h"

namespace bytecomp::config {
namespace {

std::string location(const std::string& file, const YAML::Mark& mark) {
  if (mark.is_null()) return file;
  return file + ":" + std::to_string(mark.line + 1) + ":" +
         std::to_string(mark.column + 1);
}

template <class T>
std::string range_text(Range<T> r) {
  std::ostringstream s;
  s << r.min << ".." << r.max;
  return s.str();
}

template <class Items>
std::string join(const Items& items) {
  std::string s;
  for (const auto& it : items) {
    if (!s.empty()) s += ", ";
    s += it;
  }
  return s;
}

}  // namespace

// ---------------------------------------------------------------- Document

Document Document::load_file(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw ConfigError(path + ": cannot open configuration file (" +
                      std::string(std::strerror(errno)) + ")");
  std::stringstream buf;
  buf << in.rdbuf();
  if (recording_inputs()) {
    const std::string text = buf.str();
    record_input_always("config-" + std::filesystem::path(path).filename().string(), text.data(),
                        text.size());
  }
  return parse(buf.str(), path);
}

Document Document::parse(std::string_view text, std::string name) {
  YAML::Node node;
  try {
    node = YAML::Load(std::string(text));
  } catch (const YAML::ParserException& e) {
    throw ConfigError(location(name, e.mark) + ": YAML syntax error: " + e.msg);
  }
  if (node.IsNull()) node = YAML::Node(YAML::NodeType::Map);
  if (!node.IsMap())
    throw ConfigError(location(name, node.Mark()) +
                      ": the top level must be a mapping of keys (starting with "
                      "'version: 1')");
  return Document(std::move(name), std::move(node), false);
}

Document Document::defaults(std::string name) {
  return Document(std::move(name), YAML::Node(YAML::NodeType::Map), true);
}

Document Document::locate(const std::optional<std::string>& explicit_path,
                          std::string_view file_name) {
  if (explicit_path) {
    if (!std::filesystem::exists(*explicit_path))
      throw ConfigError(*explicit_path + ": configuration file given with "
                        "--config does not exist");
    Document doc = load_file(*explicit_path);
    doc.merge_drop_ins(*explicit_path + ".d");
    return doc;
  }
  const char* dir_env = std::getenv("BYTECOMP_SYSCONFDIR");
  std::filesystem::path dir = (dir_env && *dir_env) ? dir_env : "/etc/bytecomp";
  std::filesystem::path p = dir / file_name;
  Document doc = std::filesystem::exists(p) ? load_file(p.string()) : defaults();
  doc.merge_drop_ins(p.string() + ".d");
  return doc;
}

namespace {

void record(Document::Origins& o, const YAML::Node& n, const std::string& file) {
  o.nodes.emplace_back(n, file);
  if (n.IsMap()) {
    for (const auto& kv : n) record(o, kv.second, file);
  } else if (n.IsSequence()) {
    for (const auto& item : n) record(o, item, file);
  }
}

// Mappings merge key by key; anything else replaces what was there.
void merge_into(YAML::Node dst, const YAML::Node& src, Document::Origins& o,
                const std::string& file) {
  for (const auto& kv : src) {
    const std::string key = kv.first.Scalar();
    // The const lookup: a non-const operator[] would add an undefined entry.
    const YAML::Node& cdst = dst;
    YAML::Node have = cdst[key];
    if (have.IsDefined() && have.IsMap() && kv.second.IsMap()) {
      merge_into(have, kv.second, o, file);
      continue;
    }
    record(o, kv.second, file);
    if (have.IsDefined()) {
      dst[key] = kv.second;
    } else {
      // The drop-in's key node keeps its line for "unknown key" errors.
      dst.force_insert(kv.first, kv.second);
    }
  }
}

}  // namespace

const std::string* Document::Origins::find(const YAML::Node& n) const {
  for (const auto& [node, file] : nodes) {
    if (node.is(n)) return &file;
  }
  return nullptr;
}

void Document::merge(const Document& drop_in) {
  const YAML::Node& src = drop_in.node_;
  Reader check = drop_in.root("");  // version: 1, with the drop-in's location
  (void)check;
  if (defaults_) {
    // Defaults plus drop-ins: the drop-ins carry the version.
    defaults_ = false;
    node_ = YAML::Node(YAML::NodeType::Map);
  }
  merge_into(node_, src, *origins_, drop_in.name_);
  sources_.push_back(drop_in.name_);
}

void Document::merge_drop_ins(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return;
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 5 && n.compare(n.size() - 5, 5, ".yaml") == 0 && n.front() != '.' &&
        e.is_regular_file(ec)) {
      files.push_back(e.path().string());
    }
  }
  if (ec) throw ConfigError(dir + ": cannot list the drop-in directory (" + ec.message() + ")");
  std::sort(files.begin(), files.end());
  for (const auto& f : files) merge(load_file(f));
}

Reader Document::root(std::string env_prefix) const {
  bool env = !env_prefix.empty();
  Reader r(name_, "", node_, std::move(env_prefix), env, origins_);
  if (!defaults_) {
    if (!r.has("version"))
      r.fail("", "missing required key 'version'", "version: 1");
    int64_t version = 0;
    r.get("version", version);
    if (version != 1)
      r.fail("version",
             "unsupported configuration version " + std::to_string(version),
             "1");
  } else {
    r.seen_.insert("version");
  }
  return r;
}

// ------------------------------------------------------------------ Reader

Reader::Reader(std::string file, std::string path, YAML::Node node,
               std::string env_prefix, bool env_enabled,
               std::shared_ptr<const Document::Origins> origins)
    : file_(std::move(file)),
      path_(std::move(path)),
      node_(std::move(node)),
      env_prefix_(std::move(env_prefix)),
      env_enabled_(env_enabled),
      origins_(std::move(origins)) {}

const std::string& Reader::file_of(const YAML::Node& n) const {
  if (origins_ && n.IsDefined()) {
    if (const std::string* f = origins_->find(n)) return *f;
  }
  return file_;
}

std::string Reader::key_path(std::string_view key) const {
  if (path_.empty()) return std::string(key);
  if (key.empty()) return path_;
  return path_ + "." + std::string(key);
}

std::string Reader::env_name(std::string_view key) const {
  std::string name = env_prefix_ + "_";
  for (char c : key_path(key)) {
    if (c == '.' || c == '-')
      name += '_';
    else
      name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return name;
}

bool Reader::has(std::string_view key) const {
  if (env_enabled_ && std::getenv(env_name(key).c_str()) != nullptr) return true;
  return node_.IsMap() && node_[std::string(key)].IsDefined();
}

std::optional<Reader::Value> Reader::scalar(std::string_view key) {
  seen_.insert(std::string(key));
  if (env_enabled_) {
    std::string name = env_name(key);
    if (const char* v = std::getenv(name.c_str())) {
      Value val;
      val.text = v;
      val.from_env = true;
      val.env_name = name;
      return val;
    }
  }
  if (!node_.IsMap()) return std::nullopt;
  YAML::Node n = node_[std::string(key)];
  if (!n.IsDefined()) return std::nullopt;
  Value val;
  val.node = n;
  if (!n.IsScalar()) {
    fail_value(val, key,
               std::string("expected a single value but found a ") +
                   (n.IsMap() ? "mapping" : n.IsSequence() ? "list" : "null"),
               "");
  }
  val.text = n.Scalar();
  return val;
}

std::string Reader::where(const Value& v, std::string_view key) const {
  if (v.from_env)
    return "environment variable " + v.env_name + " (overrides '" +
           key_path(key) + "' of " + file_ + ")";
  return location(file_of(v.node), v.node.Mark()) + ": key '" + key_path(key) + "'";
}

void Reader::fail_value(const Value& v, std::string_view key,
                        const std::string& problem,
                        const std::string& accepted) const {
  std::string msg = where(v, key) + ": " + problem;
  if (!accepted.empty()) msg += " (accepted: " + accepted + ")";
  throw ConfigError(msg);
}

void Reader::fail(std::string_view key, const std::string& problem,
                  const std::string& accepted) const {
  YAML::Mark mark = node_.Mark();
  const std::string* file = &file_of(node_);
  if (!key.empty() && node_.IsMap()) {
    YAML::Node n = node_[std::string(key)];
    if (n.IsDefined()) {
      mark = n.Mark();
      file = &file_of(n);
    }
  }
  std::string msg = location(*file, mark);
  std::string kp = key_path(key);
  if (!kp.empty()) msg += ": key '" + kp + "'";
  msg += ": " + problem;
  if (!accepted.empty()) msg += " (accepted: " + accepted + ")";
  throw ConfigError(msg);
}

Reader& Reader::require(std::string_view key) {
  if (!has(key)) fail("", "missing required key '" + key_path(key) + "'");
  return *this;
}

Reader& Reader::get(std::string_view key, bool& out) {
  auto v = scalar(key);
  if (!v) return *this;
  const std::string& t = v->text;
  if (t == "true" || t == "yes" || t == "on" || t == "1")
    out = true;
  else if (t == "false" || t == "no" || t == "off" || t == "0")
    out = false;
  else
    fail_value(*v, key, "'" + t + "' is not a boolean", "true, false");
  return *this;
}

Reader& Reader::get(std::string_view key, std::string& out) {
  auto v = scalar(key);
  if (v) out = v->text;
  return *this;
}

template <class T>
Reader& Reader::get_number(std::string_view key, T& out, Range<T> range,
                           const char* type_name) {
  auto v = scalar(key);
  if (!v) return *this;
  const std::string& t = v->text;
  T value{};
  const char* first = t.data();
  const char* last = t.data() + t.size();
  if (first != last && *first == '+') ++first;
  auto [ptr, ec] = std::from_chars(first, last, value);
  if (ec == std::errc::result_out_of_range)
    fail_value(*v, key, "'" + t + "' does not fit in " + type_name,
               range_text(range));
  if (ec != std::errc() || ptr != last || t.empty())
    fail_value(*v, key, "'" + t + "' is not " + type_name, range_text(range));
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(value))
      fail_value(*v, key, "'" + t + "' is not a finite number", range_text(range));
  }
  if (value < range.min || value > range.max) {
    std::ostringstream s;
    s << value << " is out of range";
    fail_value(*v, key, s.str(), range_text(range));
  }
  out = value;
  return *this;
}

Reader& Reader::get(std::string_view key, int64_t& out, Range<int64_t> range) {
  return get_number(key, out, range, "an integer");
}
Reader& Reader::get(std::string_view key, int& out, Range<int> range) {
  return get_number(key, out, range, "an integer");
}
Reader& Reader::get(std::string_view key, uint32_t& out, Range<uint32_t> range) {
  return get_number(key, out, range, "a non-negative integer");
}
Reader& Reader::get(std::string_view key, uint64_t& out, Range<uint64_t> range) {
  return get_number(key, out, range, "a non-negative integer");
}
Reader& Reader::get(std::string_view key, double& out, Range<double> range) {
  return get_number(key, out, range, "a number");
}

Reader& Reader::get_bytes(std::string_view key, uint64_t& out,
                          Range<uint64_t> range) {
  auto v = scalar(key);
  if (!v) return *this;
  const std::string& t = v->text;
  const std::string accepted =
      "an integer with optional unit B, KiB, MiB, GiB, KB, MB, GB; " +
      range_text(range) + " bytes";
  uint64_t number = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), number);
  if (ec != std::errc() || ptr == t.data())
    fail_value(*v, key, "'" + t + "' is not a byte size", accepted);
  std::string unit(ptr, t.data() + t.size());
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  uint64_t mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KiB") mult = 1ull << 10;
  else if (unit == "MiB") mult = 1ull << 20;
  else if (unit == "GiB") mult = 1ull << 30;
  else if (unit == "KB") mult = 1000;
  else if (unit == "MB") mult = 1000 * 1000;
  else if (unit == "GB") mult = 1000ull * 1000 * 1000;
  else fail_value(*v, key, "unknown unit '" + unit + "'", accepted);
  if (number > std::numeric_limits<uint64_t>::max() / mult)
    fail_value(*v, key, "'" + t + "' is too large", accepted);
  uint64_t bytes = number * mult;
  if (bytes < range.min || bytes > range.max)
    fail_value(*v, key, std::to_string(bytes) + " bytes is out of range", accepted);
  out = bytes;
  return *this;
}

Reader& Reader::get_enum(std::string_view key, std::string& out,
                         std::initializer_list<std::string_view> accepted) {
  auto v = scalar(key);
  if (!v) return *this;
  for (auto a : accepted) {
    if (v->text == a) {
      out = v->text;
      return *this;
    }
  }
  fail_value(*v, key, "'" + v->text + "' is not a valid choice", join(accepted));
}

Reader& Reader::get_enum(std::string_view key, std::string& out,
                         const std::vector<std::string>& accepted) {
  auto v = scalar(key);
  if (!v) return *this;
  for (const auto& a : accepted) {
    if (v->text == a) {
      out = v->text;
      return *this;
    }
  }
  fail_value(*v, key, "'" + v->text + "' is not a valid choice", join(accepted));
}

Reader& Reader::get(std::string_view key, std::vector<std::string>& out) {
  seen_.insert(std::string(key));
  if (!node_.IsMap()) return *this;
  YAML::Node n = node_[std::string(key)];
  if (!n.IsDefined()) return *this;
  if (!n.IsSequence()) {
    Value val;
    val.node = n;
    fail_value(val, key, "expected a list of strings", "[a, b, ...]");
  }
  std::vector<std::string> result;
  for (const auto& item : n) {
    if (!item.IsScalar()) {
      Value val;
      val.node = static_cast<const YAML::Node&>(item);
      fail_value(val, key, "list items must be plain strings", "[a, b, ...]");
    }
    result.push_back(item.Scalar());
  }
  out = std::move(result);
  return *this;
}

Reader Reader::section(std::string_view key) {
  seen_.insert(std::string(key));
  YAML::Node n;
  if (node_.IsMap()) n = node_[std::string(key)];
  if (!n.IsDefined() || n.IsNull()) n = YAML::Node(YAML::NodeType::Map);
  if (!n.IsMap()) {
    Value val;
    val.node = n;
    fail_value(val, key, "expected a mapping of keys", "key: value pairs");
  }
  return Reader(file_, key_path(key), n, env_prefix_, env_enabled_, origins_);
}

std::vector<Reader> Reader::list(std::string_view key) {
  seen_.insert(std::string(key));
  std::vector<Reader> out;
  if (!node_.IsMap()) return out;
  YAML::Node n = node_[std::string(key)];
  if (!n.IsDefined() || n.IsNull()) return out;
  if (!n.IsSequence()) {
    Value val;
    val.node = n;
    fail_value(val, key, "expected a list", "- item ...");
  }
  size_t i = 0;
  for (const auto& item : n) {
    std::string p = key_path(key) + "[" + std::to_string(i++) + "]";
    if (!item.IsMap())
      throw ConfigError(location(file_of(item), item.Mark()) + ": key '" + p +
                        "': expected a mapping of keys");
    out.push_back(Reader(file_, p, item, env_prefix_, false, origins_));
  }
  return out;
}

void Reader::finish() const {
  if (!node_.IsMap()) return;
  for (const auto& kv : node_) {
    const std::string k = kv.first.Scalar();
    if (seen_.count(k)) continue;
    std::string accepted;
    for (const auto& s : seen_) {
      if (!accepted.empty()) accepted += ", ";
      accepted += s;
    }
    throw ConfigError(location(file_of(kv.second), kv.first.Mark()) + ": unknown key '" +
                      key_path(k) + "'" +
                      (accepted.empty() ? std::string(" (this section takes no keys)")
                                        : " (accepted: " + accepted + ")"));
  }
}

}  // namespace bytecomp::config
