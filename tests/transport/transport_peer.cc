// A transport node in its own process, driven by the transport tests (and
// scripts/bench-transport). Prints "ADDR <endpoint>" once listening, serves
// the test protocol (protocol.h) and exits when stdin closes.
//
//   transport_peer --config FILE --node N [--connect ID=ADDR]...
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "common/config.h"
#include "common/log.h"
#include "tests/transport/protocol.h"
#include "transport/transport.h"

using namespace bytecomp;
using namespace bytecomp::transport;
namespace tp = bytecomp::transport::testproto;

namespace {

struct State {
  std::mutex mu;
  std::map<std::pair<NodeId, uint64_t>, uint64_t> next_seq;
  uint64_t msgs = 0, errors = 0, bytes = 0;
  std::set<NodeId> lost;
};

void serve(Transport& t, State& st) {
  auto echo = [&t](Incoming in) {
    if (in.expects_reply) {
      t.reply(in, std::move(in.message), nullptr);
    } else {
      t.send(in.from, std::move(in.message), nullptr);
    }
  };
  t.set_handler(tp::kEcho, echo);
  t.set_inline_handler(tp::kEchoInline, echo);
  t.set_handler(tp::kSeq, [&st](Incoming in) {
    std::lock_guard lock(st.mu);
    uint64_t& next = st.next_seq[{in.from, in.message.header.key}];
    if (in.message.header.arg != next) ++st.errors;
    next = in.message.header.arg + 1;
    ++st.msgs;
    st.bytes += in.message.payload_bytes();
  });
  t.set_handler(tp::kStats, [&t, &st](Incoming in) {
    std::ostringstream s;
    {
      std::lock_guard lock(st.mu);
      s << "msgs=" << st.msgs << " errors=" << st.errors << " bytes=" << st.bytes << " lost=";
      for (NodeId id : st.lost) s << id << ",";
    }
    Message m;
    m.header.type = tp::kStats;
    m.payloads.push_back(Buffer::copy_of(s.str()));
    t.reply(in, std::move(m), nullptr);
  });
  t.set_handler(tp::kSlow, [&t](Incoming in) {
    std::this_thread::sleep_for(Millis(in.message.header.arg));
    t.reply(in, Message{in.message.header, {}}, nullptr);
  });
  t.set_handler(tp::kStall, [](Incoming in) {
    std::this_thread::sleep_for(Millis(in.message.header.arg));
  });
  t.set_handler(tp::kHash, [&t](Incoming in) {
    Message m;
    m.header.type = tp::kHash;
    if (!in.message.payloads.empty()) {
      m.header.key = tp::checksum(in.message.payloads[0].span());
      m.header.arg = in.message.payloads[0].size();
    }
    t.reply(in, std::move(m), nullptr);
  });
  t.set_handler(tp::kBlast, [&t](Incoming in) {
    NodeId target = static_cast<NodeId>(in.message.header.key);
    uint64_t count = in.message.header.arg;
    size_t size = in.message.header.aux;
    // One pattern buffer shared by every message (zero-copy sends).
    Buffer data = Buffer::allocate(size);
    tp::fill_pattern(data.mutable_data(), size, t.self());
    // Shared with the callbacks: they may outlive this handler if it gives up.
    struct Progress {
      std::mutex mu;
      std::condition_variable cv;
      uint64_t done = 0, failed = 0;
    };
    auto pr = std::make_shared<Progress>();
    for (uint64_t i = 0; i < count; ++i) {
      Message m;
      m.header.type = tp::kSeq;
      m.header.key = t.self();
      m.header.arg = i;
      m.payloads.push_back(data);
      t.send(target, std::move(m), [pr](const Status& s) {
        std::lock_guard lock(pr->mu);
        if (!s.ok()) pr->failed++;
        pr->done++;
        pr->cv.notify_all();
      });
    }
    uint64_t failed;
    {
      std::unique_lock lock(pr->mu);
      pr->cv.wait_for(lock, std::chrono::seconds(120), [&] { return pr->done == count; });
      failed = pr->failed + (count - pr->done);
    }
    Message m;
    m.header.type = tp::kBlast;
    m.header.arg = count - failed;
    m.header.aux = static_cast<uint32_t>(failed);
    t.reply(in, std::move(m), nullptr);
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  NodeId node = 1;
  std::vector<std::pair<NodeId, std::string>> connect;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) {
      config_path = argv[++i];
    } else if (a == "--node" && i + 1 < argc) {
      node = static_cast<NodeId>(std::stoul(argv[++i]));
    } else if (a == "--connect" && i + 1 < argc) {
      std::string c = argv[++i];
      auto eq = c.find('=');
      if (eq == std::string::npos) {
        std::cerr << "transport_peer: --connect wants ID=ADDR, got '" << c << "'\n";
        return 2;
      }
      connect.emplace_back(static_cast<NodeId>(std::stoul(c.substr(0, eq))), c.substr(eq + 1));
    } else {
      std::cerr << "usage: transport_peer --config FILE --node N [--connect ID=ADDR]...\n";
      return 2;
    }
  }
  try {
    bytecomp::log::configure_from_env();
    config::Document doc = config_path.empty() ? config::Document::defaults()
                                               : config::Document::load_file(config_path);
    config::Reader root = doc.root("BCPEER");
    config::Reader section = root.section("transport");
    TransportConfig cfg = read_transport_config(section);
    root.finish();
    cfg.node_id = node;
    State st;
    auto t = make_transport(cfg);
    t->on_peer_failure([&st](NodeId id, const Status&) {
      std::lock_guard lock(st.mu);
      st.lost.insert(id);
    });
    serve(*t, st);
    for (auto& [id, addr] : connect) t->add_peer(id, addr);
    t->start();
    std::printf("ADDR %s\n", t->local_addresses().empty() ? "-" : t->local_addresses()[0].c_str());
    std::fflush(stdout);
    // Lives until the test closes our stdin (or dies, which closes it too).
    char buf[256];
    while (read(0, buf, sizeof buf) > 0) {
    }
    t->shutdown();
  } catch (const std::exception& e) {
    std::cerr << "transport_peer: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
