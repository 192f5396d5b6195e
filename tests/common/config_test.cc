#include "common/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using bytecomp::config::ConfigError;
using bytecomp::config::Document;
using bytecomp::config::Range;
using bytecomp::config::Reader;

namespace {

// A small schema shaped like the real ones, to exercise every error class.
struct Sample {
  int io_threads = 2;
  std::string mode = "ps";
  bool secure = false;
  uint64_t partition = 4 << 20;
  double ratio = 0.01;
  std::vector<std::string> peers;
  struct Peer {
    std::string host;
    int port = 0;
  };
  std::vector<Peer> servers;
};

Sample parse(const Document& doc) {
  Sample s;
  Reader root = doc.root("BCTEST");
  Reader t = root.section("transport");
  t.get("io_threads", s.io_threads, Range<int>{1, 64})
      .get_enum("mode", s.mode, {"ps", "allgather"})
      .get("secure", s.secure)
      .get_bytes("partition", s.partition, {4096, 1ull << 30})
      .get("ratio", s.ratio, Range<double>{0.0, 1.0})
      .get("peers", s.peers);
  t.finish();
  for (Reader& r : root.list("servers")) {
    Sample::Peer p;
    r.require("host").get("host", p.host).get("port", p.port, Range<int>{1, 65535});
    r.finish();
    s.servers.push_back(p);
  }
  root.finish();
  return s;
}

std::string error_of(const std::string& text) {
  try {
    parse(Document::parse(text, "sample.yaml"));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Config, ValidDocumentParses) {
  Sample s = parse(Document::parse(R"(
version: 1
transport:
  io_threads: 4
  mode: allgather
  secure: true
  partition: 8MiB
  ratio: 0.5
  peers: [a, b]
servers:
  - {host: h1, port: 9000}
  - {host: h2}
)", "sample.yaml"));
  EXPECT_EQ(s.io_threads, 4);
  EXPECT_EQ(s.mode, "allgather");
  EXPECT_TRUE(s.secure);
  EXPECT_EQ(s.partition, 8u << 20);
  EXPECT_DOUBLE_EQ(s.ratio, 0.5);
  EXPECT_EQ(s.peers, (std::vector<std::string>{"a", "b"}));
  ASSERT_EQ(s.servers.size(), 2u);
  EXPECT_EQ(s.servers[0].port, 9000);
  EXPECT_EQ(s.servers[1].host, "h2");
}

TEST(Config, DefaultsKeepFieldValues) {
  Sample s = parse(Document::defaults());
  EXPECT_EQ(s.io_threads, 2);
  EXPECT_EQ(s.mode, "ps");
}

TEST(Config, SyntaxErrorNamesFileLineColumn) {
  std::string e = error_of("version: 1\ntransport:\n  io_threads: [1, 2\n");
  EXPECT_NE(e.find("sample.yaml:4:1: YAML syntax error: end of sequence flow not found"), std::string::npos) << e;
  EXPECT_NE(e.find("YAML syntax error"), std::string::npos) << e;
}

TEST(Config, MissingVersion) {
  std::string e = error_of("transport: {io_threads: 3}\n");
  EXPECT_NE(e.find("sample.yaml:1:1"), std::string::npos) << e;
  EXPECT_NE(e.find("missing required key 'version'"), std::string::npos) << e;
}

TEST(Config, WrongVersion) {
  std::string e = error_of("version: 2\n");
  EXPECT_NE(e.find("sample.yaml:1:10"), std::string::npos) << e;
  EXPECT_NE(e.find("unsupported configuration version 2"), std::string::npos) << e;
  EXPECT_NE(e.find("accepted: 1"), std::string::npos) << e;
}

TEST(Config, UnknownKeyNamesPathAndAcceptedKeys) {
  std::string e = error_of("version: 1\ntransport:\n  io_thread: 3\n");
  EXPECT_NE(e.find("sample.yaml:3:3"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key 'transport.io_thread'"), std::string::npos) << e;
  EXPECT_NE(e.find("io_threads"), std::string::npos) << e;
}

TEST(Config, UnknownTopLevelKey) {
  std::string e = error_of("version: 1\nbogus: 1\n");
  EXPECT_NE(e.find("sample.yaml:2:1: unknown key 'bogus'"), std::string::npos) << e;
}

TEST(Config, WrongType) {
  std::string e = error_of("version: 1\ntransport:\n  io_threads: many\n");
  EXPECT_NE(e.find("sample.yaml:3:15: key 'transport.io_threads'"), std::string::npos) << e;
  EXPECT_NE(e.find("'many' is not an integer"), std::string::npos) << e;
  EXPECT_NE(e.find("accepted: 1..64"), std::string::npos) << e;
  e = error_of("version: 1\ntransport:\n  secure: maybe\n");
  EXPECT_NE(e.find("'maybe' is not a boolean"), std::string::npos) << e;
  e = error_of("version: 1\ntransport:\n  io_threads: {a: 1}\n");
  EXPECT_NE(e.find("expected a single value but found a mapping"), std::string::npos) << e;
  e = error_of("version: 1\ntransport: 5\n");
  EXPECT_NE(e.find("key 'transport': expected a mapping"), std::string::npos) << e;
  e = error_of("version: 1\ntransport:\n  ratio: 1.5x\n");
  EXPECT_NE(e.find("'1.5x' is not a number"), std::string::npos) << e;
}

TEST(Config, OutOfRange) {
  std::string e = error_of("version: 1\ntransport:\n  io_threads: 99\n");
  EXPECT_NE(e.find("99 is out of range (accepted: 1..64)"), std::string::npos) << e;
  e = error_of("version: 1\ntransport:\n  partition: 2GiB\n");
  EXPECT_NE(e.find("2147483648 bytes is out of range"), std::string::npos) << e;
  e = error_of("version: 1\ntransport:\n  partition: 4 parsecs\n");
  EXPECT_NE(e.find("unknown unit 'parsecs'"), std::string::npos) << e;
  e = error_of("version: 1\ntransport:\n  io_threads: 99999999999999999999\n");
  EXPECT_NE(e.find("does not fit"), std::string::npos) << e;
}

TEST(Config, EnumNamesAcceptedValues) {
  std::string e = error_of("version: 1\ntransport:\n  mode: ring\n");
  EXPECT_NE(e.find("'ring' is not a valid choice (accepted: ps, allgather)"),
            std::string::npos) << e;
}

TEST(Config, ListItemErrorsNameTheIndex) {
  std::string e = error_of("version: 1\nservers:\n  - {host: a}\n  - {port: 1}\n");
  EXPECT_NE(e.find("missing required key 'servers[1].host'"), std::string::npos) << e;
  e = error_of("version: 1\nservers:\n  - {host: a, colour: red}\n");
  EXPECT_NE(e.find("unknown key 'servers[0].colour'"), std::string::npos) << e;
}

TEST(Config, EnvironmentOverridesFileValue) {
  setenv("BCTEST_TRANSPORT_IO_THREADS", "7", 1);
  Sample s = parse(Document::parse("version: 1\ntransport: {io_threads: 3}\n", "s.yaml"));
  EXPECT_EQ(s.io_threads, 7);
  // An override also applies when the file does not mention the key.
  s = parse(Document::defaults());
  EXPECT_EQ(s.io_threads, 7);
  setenv("BCTEST_TRANSPORT_IO_THREADS", "0", 1);
  std::string e = error_of("version: 1\n");
  EXPECT_NE(e.find("environment variable BCTEST_TRANSPORT_IO_THREADS"), std::string::npos) << e;
  EXPECT_NE(e.find("0 is out of range"), std::string::npos) << e;
  unsetenv("BCTEST_TRANSPORT_IO_THREADS");
}

TEST(Config, LocateFollowsLookupOrder) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("bctest-etc-" + std::to_string(getpid()));
  fs::create_directories(dir);
  setenv("BYTECOMP_SYSCONFDIR", dir.c_str(), 1);
  // Nothing in the directory: built-in defaults.
  EXPECT_TRUE(Document::locate(std::nullopt, "sample.yaml").is_defaults());
  std::ofstream(dir / "sample.yaml") << "version: 1\ntransport: {io_threads: 5}\n";
  Document etc = Document::locate(std::nullopt, "sample.yaml");
  EXPECT_EQ(etc.name(), (dir / "sample.yaml").string());
  EXPECT_EQ(parse(etc).io_threads, 5);
  // An explicit path wins, and must exist.
  fs::path mine = dir / "mine.yaml";
  std::ofstream(mine) << "version: 1\ntransport: {io_threads: 6}\n";
  EXPECT_EQ(parse(Document::locate(mine.string(), "sample.yaml")).io_threads, 6);
  EXPECT_THROW(Document::locate((dir / "nope.yaml").string(), "sample.yaml"), ConfigError);
  unsetenv("BYTECOMP_SYSCONFDIR");
  fs::remove_all(dir);
}

TEST(Config, EveryExampleFileIsVersionedYaml) {
  // Schema checks live with each component's tests; here: every example parses
  // and declares version 1.
  const char* root = std::getenv("BYTECOMP_SOURCE_ROOT");
  ASSERT_NE(root, nullptr);
  for (const auto& entry : std::filesystem::directory_iterator(std::string(root) + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    SCOPED_TRACE(entry.path().string());
    Document doc = Document::load_file(entry.path().string());
    EXPECT_NO_THROW(doc.root(""));
  }
}

}  // namespace

#include "common/log.h"
#include "common/logging_config.h"

namespace {

TEST(Config, LoggingSectionAppliesLevels) {
  auto doc = Document::parse("version: 1\nlogging: {levels: 'warn,cfg-x=debug'}\n", "p.yaml");
  Reader root = doc.root("");
  bytecomp::config::apply_logging_section(root);
  root.finish();
  EXPECT_TRUE(bytecomp::log::category("cfg-x").enabled(bytecomp::log::Level::kDebug));
  EXPECT_FALSE(bytecomp::log::category("cfg-y").enabled(bytecomp::log::Level::kInfo));
  bytecomp::log::configure("info");
}

TEST(Config, LoggingSectionBadLevelIsLocated) {
  auto doc = Document::parse("version: 1\nlogging:\n  levels: 'cfg-z=chatty'\n", "p.yaml");
  Reader root = doc.root("");
  try {
    bytecomp::config::apply_logging_section(root);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("p.yaml:3:11: key 'logging.levels'"), std::string::npos) << m;
    EXPECT_NE(m.find("'chatty'"), std::string::npos) << m;
  }
}

}  // namespace

namespace {

namespace fs = std::filesystem;

struct DropInDir {
  fs::path dir = fs::temp_directory_path() / ("bc-dropin-" + std::to_string(::getpid()));
  DropInDir() {
    fs::remove_all(dir);
    fs::create_directories(dir / "sample.yaml.d");
  }
  ~DropInDir() { fs::remove_all(dir); }
  void write(const std::string& rel, const std::string& text) const {
    std::ofstream(dir / rel) << text;
  }
};

TEST(ConfigDropIns, MergeInNameOrderOverTheMainFile) {
  DropInDir d;
  d.write("sample.yaml",
          "version: 1\ntransport:\n  io_threads: 3\n  mode: ps\n  peers: [a, b]\n");
  // 20 sorts after 10 and wins where both set a key; a mapping merges key by
  // key, a list is replaced; other files in the directory are ignored.
  d.write("sample.yaml.d/20-late.yaml", "version: 1\ntransport:\n  io_threads: 9\n");
  d.write("sample.yaml.d/10-early.yaml",
          "version: 1\ntransport:\n  io_threads: 5\n  secure: true\n  peers: [c]\n");
  d.write("sample.yaml.d/README", "not yaml: [");
  d.write("sample.yaml.d/.hidden.yaml", "not yaml: [");
  Document doc = Document::locate((d.dir / "sample.yaml").string(), "sample.yaml");
  Sample s = parse(doc);
  EXPECT_EQ(s.io_threads, 9);
  EXPECT_TRUE(s.secure);
  EXPECT_EQ(s.mode, "ps");
  EXPECT_EQ(s.peers, std::vector<std::string>{"c"});
  ASSERT_EQ(doc.sources().size(), 3u);
  EXPECT_EQ(doc.sources()[0], (d.dir / "sample.yaml").string());
  EXPECT_EQ(doc.sources()[1], (d.dir / "sample.yaml.d/10-early.yaml").string());
  EXPECT_EQ(doc.sources()[2], (d.dir / "sample.yaml.d/20-late.yaml").string());
}

TEST(ConfigDropIns, ApplyOverBuiltInDefaultsInTheSysconfDir) {
  DropInDir d;
  d.write("sample.yaml.d/50-threads.yaml", "version: 1\ntransport:\n  io_threads: 7\n");
  setenv("BYTECOMP_SYSCONFDIR", d.dir.c_str(), 1);
  Document doc = Document::locate(std::nullopt, "sample.yaml");
  unsetenv("BYTECOMP_SYSCONFDIR");
  EXPECT_EQ(parse(doc).io_threads, 7);
  EXPECT_EQ(doc.sources().size(), 1u);
}

TEST(ConfigDropIns, ErrorsNameTheDropInFileAndLine) {
  DropInDir d;
  d.write("sample.yaml", "version: 1\ntransport:\n  io_threads: 3\n");
  d.write("sample.yaml.d/10-bad.yaml", "version: 1\n\ntransport:\n  io_threads: 99\n");
  const std::string bad = (d.dir / "sample.yaml.d/10-bad.yaml").string();
  try {
    parse(Document::locate((d.dir / "sample.yaml").string(), "sample.yaml"));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(bad + ":4:15: key 'transport.io_threads': 99 is out of range"),
              std::string::npos)
        << e.what();
  }
  // An unknown key in a drop-in is located in the drop-in, a good key of the
  // main file still in the main file.
  d.write("sample.yaml.d/10-bad.yaml", "version: 1\ntransport:\n  io_thread: 4\n");
  try {
    parse(Document::locate((d.dir / "sample.yaml").string(), "sample.yaml"));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(bad + ":3:3: unknown key 'transport.io_thread'"),
              std::string::npos)
        << e.what();
  }
  d.write("sample.yaml", "version: 1\ntransport:\n  io_threads: 0\n");
  d.write("sample.yaml.d/10-bad.yaml", "version: 1\ntransport:\n  secure: true\n");
  try {
    parse(Document::locate((d.dir / "sample.yaml").string(), "sample.yaml"));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find((d.dir / "sample.yaml").string() + ":3:15:"),
              std::string::npos)
        << e.what();
  }
  // Every drop-in is versioned; a syntax error names its file and line.
  d.write("sample.yaml", "version: 1\n");
  d.write("sample.yaml.d/10-bad.yaml", "transport:\n  io_threads: 4\n");
  try {
    Document::locate((d.dir / "sample.yaml").string(), "sample.yaml");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'version'"), std::string::npos) << e.what();
  }
  d.write("sample.yaml.d/10-bad.yaml", "version: 1\ntransport: [\n");
  try {
    Document::locate((d.dir / "sample.yaml").string(), "sample.yaml");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(bad + ":"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("YAML syntax error"), std::string::npos) << e.what();
  }
}

}  // namespace
