// Versioned YAML configuration (DESIGN.md §5, "Config").
//
// Lookup order, the one way every program finds its file:
//   1. the path given explicitly (--config PATH); it must exist;
//   2. /etc/bytecomp/<name> (the directory can be moved with the environment
//      variable BYTECOMP_SYSCONFDIR, used by tests and unprivileged installs);
//   3. built-in defaults (an empty document: every key keeps its default).
// Then drop-ins: every `*.yaml` in the directory `<file>.d/` next to the file
// found (or that would have been: /etc/bytecomp/daemon.yaml.d/ applies over
// the built-in defaults too), in byte order of their names, each starting
// with `version: 1`. A drop-in's mappings merge into the document key by key;
// any other value (a scalar or a list) replaces the one before it. Errors in
// a key that came from a drop-in name the drop-in's file and line.
// Then environment variables override single keys: the key path upper-cased,
// dots and dashes turned into '_', behind the program's prefix, e.g.
// `transport.io_threads` of bytecompd is BYTECOMPD_TRANSPORT_IO_THREADS.
//
// Every file starts with `version: 1`. Every key read goes through Reader,
// which checks type and range and, at finish(), that no unknown key is left.
// Each failure throws ConfigError with one message naming file, line, column,
// key path, the problem and what is accepted:
//   daemon.yaml:7:15: key 'transport.io_threads': 99 is out of range (accepted: 1..64)
//
// Thread-safety: Document and Reader are neither thread-safe nor thread-bound;
// use them from one thread at a time (config is read at start-up/reload).
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace bytecomp::config {

class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& message)
      : Error(ErrorCode::kConfig, message) {}
};

template <class T>
struct Range {
  T min = std::numeric_limits<T>::lowest();
  T max = std::numeric_limits<T>::max();
};

class Reader;

class Document {
 public:
  // Throws ConfigError for a missing/unreadable file or a YAML syntax error
  // (with the parser's line and column).
  static Document load_file(const std::string& path);
  // `name` stands for the file name in messages.
  static Document parse(std::string_view text, std::string name);
  static Document defaults(std::string name = "<built-in defaults>");

  // Follows the lookup order above. `file_name` is e.g. "daemon.yaml".
  static Document locate(const std::optional<std::string>& explicit_path,
                         std::string_view file_name);

  // The top-level mapping. `env_prefix` (e.g. "BYTECOMPD") enables
  // environment overrides; empty disables them. Checks `version` (must be 1)
  // unless the document is the built-in defaults.
  Reader root(std::string env_prefix) const;

  // Merges `drop_in` (a parsed drop-in file) over this document, as
  // locate() does for `<file>.d/*.yaml`. Throws ConfigError when the drop-in
  // lacks `version: 1`.
  void merge(const Document& drop_in);
  // Merges every `*.yaml` in `dir` (absent: nothing) in name order.
  void merge_drop_ins(const std::string& dir);

  const std::string& name() const { return name_; }
  bool is_defaults() const { return defaults_; }
  // The files this document was read from, main file first, then the
  // drop-ins in merge order (empty for the built-in defaults alone).
  const std::vector<std::string>& sources() const { return sources_; }

  // Which file a node came from (for a key merged from a drop-in: the
  // drop-in).
  struct Origins {
    std::vector<std::pair<YAML::Node, std::string>> nodes;
    const std::string* find(const YAML::Node& n) const;
  };

 private:
  Document(std::string name, YAML::Node node, bool defaults)
      : name_(std::move(name)), node_(std::move(node)), defaults_(defaults),
        origins_(std::make_shared<Origins>()) {
    if (!defaults_) sources_.push_back(name_);
  }
  std::string name_;
  YAML::Node node_;
  bool defaults_ = false;
  std::vector<std::string> sources_;
  std::shared_ptr<Origins> origins_;
};

class Reader {
 public:
  // Scalars: a missing key leaves `out` untouched (so fields carry their
  // defaults). Present keys are type- and range-checked.
  Reader& get(std::string_view key, bool& out);
  Reader& get(std::string_view key, std::string& out);
  Reader& get(std::string_view key, int64_t& out, Range<int64_t> range = {});
  Reader& get(std::string_view key, int& out, Range<int> range = {});
  Reader& get(std::string_view key, uint32_t& out, Range<uint32_t> range = {});
  Reader& get(std::string_view key, uint64_t& out, Range<uint64_t> range = {});
  Reader& get(std::string_view key, double& out, Range<double> range = {});
  // Byte sizes: an integer or a string with a unit (B, KiB, MiB, GiB, KB, MB, GB).
  Reader& get_bytes(std::string_view key, uint64_t& out, Range<uint64_t> range = {});
  // One of a fixed set of strings.
  Reader& get_enum(std::string_view key, std::string& out,
                   std::initializer_list<std::string_view> accepted);
  Reader& get_enum(std::string_view key, std::string& out,
                   const std::vector<std::string>& accepted);
  Reader& get(std::string_view key, std::vector<std::string>& out);

  bool has(std::string_view key) const;
  // Throws unless the key is present.
  Reader& require(std::string_view key);

  // A nested mapping; a missing key yields an empty section.
  Reader section(std::string_view key);
  // A sequence of mappings (environment overrides do not reach into lists).
  std::vector<Reader> list(std::string_view key);

  // Throws if the mapping holds keys that were never read.
  void finish() const;

  // Throws ConfigError located at `key` (or at this section when empty), for
  // cross-field checks the typed getters cannot express.
  [[noreturn]] void fail(std::string_view key, const std::string& problem,
                         const std::string& accepted = {}) const;

  const std::string& path() const { return path_; }
  const std::string& file() const { return file_; }

 private:
  friend class Document;
  Reader(std::string file, std::string path, YAML::Node node,
         std::string env_prefix, bool env_enabled,
         std::shared_ptr<const Document::Origins> origins);
  // `file_` unless `n` came from a drop-in.
  const std::string& file_of(const YAML::Node& n) const;

  struct Value {
    std::string text;       // scalar text
    bool from_env = false;
    std::string env_name;
    YAML::Node node;        // valid when !from_env
  };
  std::optional<Value> scalar(std::string_view key);
  std::string key_path(std::string_view key) const;
  std::string env_name(std::string_view key) const;
  std::string where(const Value& v, std::string_view key) const;
  [[noreturn]] void fail_value(const Value& v, std::string_view key,
                               const std::string& problem,
                               const std::string& accepted) const;
  template <class T>
  Reader& get_number(std::string_view key, T& out, Range<T> range,
                     const char* type_name);

  std::string file_;
  std::string path_;
  YAML::Node node_;
  std::string env_prefix_;
  bool env_enabled_ = false;
  std::shared_ptr<const Document::Origins> origins_;
  std::set<std::string, std::less<>> seen_;
};

}  // namespace bytecomp::config
