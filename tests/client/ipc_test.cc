// Control protocol, shared-memory layout and rings (no daemon needed), and
// the client library against a fake daemon speaking another protocol version.
#include <bytecomp/bytecomp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>
#include <utility>

#include "client/ipc/protocol.h"
#include "client/ipc/shm_layout.h"

namespace ipc = bytecomp::ipc;
using bytecomp::Error;
using bytecomp::ErrorCode;

namespace {

std::string malformed(const std::vector<uint8_t>& b) {
  try {
    ipc::decode(b);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformed);
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Protocol, RoundTripsEveryMessage) {
  ipc::Hello h{"job-1", 2, 4, 1, 3, "0.1.0"};
  auto d = ipc::decode(ipc::encode(h));
  ASSERT_EQ(d.type, ipc::MsgType::kHello);
  const auto& h2 = std::get<ipc::Hello>(d.msg);
  EXPECT_EQ(h2.job_id, "job-1");
  EXPECT_EQ(h2.local_rank, 2u);
  EXPECT_EQ(h2.local_size, 4u);
  EXPECT_EQ(h2.node_rank, 1u);
  EXPECT_EQ(h2.num_nodes, 3u);
  ipc::Declare dc{3, "layer.weight", 1ull << 33, ipc::DType::kInt64, ipc::Device::kCpu, 0};
  auto d2 = std::get<ipc::Declare>(ipc::decode(ipc::encode(dc)).msg);
  EXPECT_EQ(d2.index, 3u);
  EXPECT_EQ(d2.name, "layer.weight");
  EXPECT_EQ(d2.count, 1ull << 33);
  EXPECT_EQ(d2.dtype, ipc::DType::kInt64);
  auto r = std::get<ipc::Ready>(ipc::decode(ipc::encode(ipc::Ready{"seg.1", 12345})).msg);
  EXPECT_EQ(r.segment_name, "seg.1");
  EXPECT_EQ(r.segment_bytes, 12345u);
  auto a = ipc::decode(ipc::encode(ipc::ErrorMsg{6, "why"}, ipc::MsgType::kAbort));
  EXPECT_EQ(a.type, ipc::MsgType::kAbort);
  EXPECT_EQ(std::get<ipc::ErrorMsg>(a.msg).message, "why");
  EXPECT_EQ(ipc::decode(ipc::encode(ipc::Bye{})).type, ipc::MsgType::kBye);
}

TEST(Protocol, RejectsEachMalformation) {
  const auto ok = ipc::encode(ipc::Declare{0, "w", 10});
  EXPECT_NE(malformed({}).find("shorter than"), std::string::npos);
  auto b = ok;
  b[0] = 0;
  EXPECT_NE(malformed(b).find("bad magic"), std::string::npos);
  b = ok;
  b[5] = 1;
  try {
    ipc::decode(b);
    ADD_FAILURE();
  } catch (const ipc::VersionMismatch& e) {
    EXPECT_EQ(e.version, 257);
  }
  b = ok;
  b[12] = 1;
  EXPECT_NE(malformed(b).find("reserved"), std::string::npos);
  b = ok;
  b.back() = 9;  // device_index high byte: fine; dtype instead:
  b = ok;
  b[16 + 4 + 2 + 1 + 8] = 7;  // dtype after index, name, count
  EXPECT_NE(malformed(b).find("unknown dtype 7"), std::string::npos);
  // Every truncation of a valid message is caught (header length adjusted).
  for (size_t cut = 1; cut < ok.size() - 16; ++cut) {
    b = ok;
    b.resize(ok.size() - cut);
    b[8] = static_cast<uint8_t>(b.size() - 16);
    EXPECT_NE(malformed(b).find("truncated"), std::string::npos) << cut;
  }
  EXPECT_NE(malformed(ipc::encode(ipc::ErrorMsg{0, "x"})).find("out of range"), std::string::npos);
  EXPECT_NE(malformed(ipc::encode(ipc::Ready{"a/b", 1})).find("bad segment name"),
            std::string::npos);
  EXPECT_NE(malformed(ipc::encode(ipc::Start{0})).find("num_tensors 0"), std::string::npos);
}

TEST(Protocol, DTypeWireCodesAreTheCAbiValues) {
  // DECLARE's dtype codes are bytecomp_dtype's values, not common/types.h's.
  const std::pair<int, ipc::DType> codes[] = {{BYTECOMP_FLOAT32, ipc::DType::kFloat32},
                                              {BYTECOMP_FLOAT64, ipc::DType::kFloat64},
                                              {BYTECOMP_INT32, ipc::DType::kInt32},
                                              {BYTECOMP_INT64, ipc::DType::kInt64}};
  static_assert(ipc::kNumDTypes == 4);
  for (const auto& [code, dtype] : codes) {
    EXPECT_EQ(ipc::dtype_to_wire(dtype), code) << ipc::dtype_name(dtype);
    ipc::DType back = ipc::DType::kFloat16;
    ASSERT_TRUE(ipc::dtype_from_wire(static_cast<uint8_t>(code), back)) << code;
    EXPECT_EQ(back, dtype);
    // On the wire: the byte after index, name and count.
    const auto b = ipc::encode(ipc::Declare{0, "w", 10, dtype});
    EXPECT_EQ(b[16 + 4 + 2 + 1 + 8], code) << ipc::dtype_name(dtype);
    EXPECT_EQ(std::get<ipc::Declare>(ipc::decode(b).msg).dtype, dtype);
  }
  EXPECT_EQ(ipc::dtype_to_wire(ipc::DType::kFloat16), ipc::kNoDTypeCode);
  EXPECT_EQ(ipc::dtype_to_wire(ipc::DType::kBFloat16), ipc::kNoDTypeCode);
  ipc::DType out = ipc::DType::kFloat32;
  EXPECT_FALSE(ipc::dtype_from_wire(4, out));
  EXPECT_FALSE(ipc::dtype_from_wire(ipc::kNoDTypeCode, out));
  EXPECT_EQ(out, ipc::DType::kFloat32);  // untouched
  try {
    ipc::encode(ipc::Declare{0, "half", 10, ipc::DType::kBFloat16});
    ADD_FAILURE() << "encoded a dtype the protocol has no code for";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'half': dtype bfloat16 has no code"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(bytecomp_dtype_size(BYTECOMP_INT32), 4u);
  EXPECT_EQ(bytecomp_dtype_size(4), 0u);  // common/types.h's kInt32 value is no C ABI value
}

TEST(Protocol, RandomBytesNeverCrash) {
  std::mt19937 rng(7);
  const auto ok = ipc::encode(ipc::Hello{"j", 0, 1, 0, 1, "v"});
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    auto b = ok;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    try {
      ipc::decode(b);
      ++accepted;
    } catch (const Error&) {
    }
  }
  EXPECT_LT(accepted, 20000);
}

TEST(Layout, AlignedDisjointAndChecked) {
  const std::vector<uint64_t> sizes{4, 1000, 64, 1 << 20};
  auto l = ipc::Layout::compute(3, sizes);
  EXPECT_EQ(l.ring_capacity, 4u);
  EXPECT_EQ(l.data_offset % 4096, 0u);
  uint64_t end = l.data_offset;
  for (size_t t = 0; t < sizes.size(); ++t) {
    EXPECT_EQ(l.tensors[t].offset % 64, 0u);
    EXPECT_GE(l.tensors[t].offset, end);
    EXPECT_GE(l.tensors[t].stride, sizes[t]);
    end = l.tensors[t].offset + 3 * l.tensors[t].stride;
  }
  EXPECT_LE(end, l.total_bytes);
  std::vector<char> mem(l.total_bytes + 64);
  void* base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
  ipc::init_segment(base, l);
  EXPECT_NE(ipc::check_segment(base, l.total_bytes, l), nullptr);
  auto other = ipc::Layout::compute(3, {4, 1000, 64, (1 << 20) + 4});
  EXPECT_THROW(ipc::check_segment(base, l.total_bytes, other), Error);
  EXPECT_THROW(ipc::Layout::compute(2, {UINT64_MAX / 2}), Error);
}

// Layout 3's per-tensor partitions (the strategy's pieces): zero until the
// daemon publishes them, which check_segment() does not compare; what the
// client then reads must add up, or it is named.
TEST(Layout, TensorPartitionsStartUnsetAndAreChecked) {
  auto l = ipc::Layout::compute(2, {160000, 0});
  std::vector<char> mem(l.total_bytes + 64);
  void* base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
  ipc::init_segment(base, l);
  auto* slots = reinterpret_cast<ipc::TensorSlot*>(static_cast<char*>(base) + l.tensors_offset);
  EXPECT_EQ(slots[0].partition_bytes, 0u);
  EXPECT_EQ(slots[0].partitions, 0u);
  slots[0].partition_bytes = 16384;  // 64 KiB cut into 4 pieces
  slots[0].partitions = 10;
  slots[1].partition_bytes = 65536;
  slots[1].partitions = 1;  // a tensor of 0 bytes still runs one
  EXPECT_NE(ipc::check_segment(base, l.total_bytes, l), nullptr);
  EXPECT_EQ(ipc::check_tensor_partitions(slots[0], 65536), "");
  EXPECT_EQ(ipc::check_tensor_partitions(slots[1], 65536), "");
  ipc::TensorSlot bad = slots[0];
  bad.partitions = 9;
  EXPECT_NE(ipc::check_tensor_partitions(bad, 65536).find("9 partitions of 16384 bytes"),
            std::string::npos);
  bad = slots[0];
  bad.partition_bytes = 16352;  // 10 partitions, but not a multiple of 64
  EXPECT_NE(ipc::check_tensor_partitions(bad, 65536), "");
  EXPECT_NE(ipc::check_tensor_partitions(slots[0], 8192), "");  // above the job's
  bad.partition_bytes = 0;
  EXPECT_NE(ipc::check_tensor_partitions(bad, 65536), "");
}

TEST(Ring, FifoFullEmptyAndCorruption) {
  ipc::RingHeader h;
  ipc::RingEntry e[4];
  ipc::Ring r(h, e, 4);
  ipc::RingEntry out;
  EXPECT_FALSE(r.pop(out));
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(r.push({i, 0, i * 10ull}));
  EXPECT_FALSE(r.push({9, 0, 0}));
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(r.pop(out));
    EXPECT_EQ(out.tensor, i);
    EXPECT_EQ(out.iteration, i * 10ull);
  }
  h.head.value = 100;  // a client scribbled over the counter
  EXPECT_THROW(r.pop(out), Error);
}

TEST(Ring, TwoThreadsPassEveryEntryOnce) {
  ipc::RingHeader h;
  std::vector<ipc::RingEntry> e(8);
  ipc::Ring r(h, e.data(), 8);
  boost::interprocess::interprocess_semaphore items(0);
  constexpr uint32_t kN = 200000;
  std::thread producer([&] {
    for (uint32_t i = 0; i < kN; ++i) {
      while (!r.push({i, 0, i})) std::this_thread::yield();
      items.post();
    }
  });
  for (uint32_t i = 0; i < kN; ++i) {
    ASSERT_TRUE(ipc::timed_wait(items, std::chrono::seconds(10)));
    ipc::RingEntry out;
    ASSERT_TRUE(r.pop(out));
    ASSERT_EQ(out.tensor, i);
  }
  producer.join();
}

TEST(Semaphore, TimedWaitTimesOut) {
  boost::interprocess::interprocess_semaphore s(0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(ipc::timed_wait(s, std::chrono::milliseconds(30)));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(25));
}

// A fake daemon answering every HELLO with a version-2 message.
TEST(Client, VersionMismatchIsReported) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("bc-fake-" + std::to_string(::getpid()) + ".sock"))
                               .string();
  ::unlink(path.c_str());
  const int ls = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  ASSERT_EQ(::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(ls, 4), 0);
  std::thread fake([&] {
    const int fd = ::accept(ls, nullptr, nullptr);
    std::vector<uint8_t> buf(70000);
    (void)::recv(fd, buf.data(), buf.size(), 0);
    auto w = ipc::encode(ipc::Welcome{"9.9", "x"});
    w[4] = 2;
    ::send(fd, w.data(), w.size(), MSG_NOSIGNAL);
    ::close(fd);
  });
  bytecomp_connect_options o;
  bytecomp_connect_options_init(&o);
  o.socket_path = path.c_str();
  o.job_id = "v";
  bytecomp_client* c = nullptr;
  EXPECT_EQ(bytecomp_connect(&o, &c), BYTECOMP_ERR_VERSION_MISMATCH);
  EXPECT_NE(std::string(bytecomp_last_error()).find("protocol version 2"), std::string::npos)
      << bytecomp_last_error();
  fake.join();
  ::close(ls);
  ::unlink(path.c_str());
}

TEST(Client, StaticHelpers) {
  EXPECT_EQ(bytecomp_abi_version(), BYTECOMP_ABI_VERSION);
  EXPECT_EQ(bytecomp_dtype_size(BYTECOMP_FLOAT64), 8u);
  EXPECT_EQ(bytecomp_dtype_size(42), 0u);
  EXPECT_STREQ(bytecomp_status_name(BYTECOMP_ERR_TIMEOUT), "BYTECOMP_ERR_TIMEOUT");
  EXPECT_STREQ(bytecomp_status_name(1234), "unknown");
  EXPECT_NE(std::string(bytecomp_version_string()).find("protocol 1"), std::string::npos);
}

TEST(Protocol, StrategyMessageRoundTripsAndIsChecked) {
  const std::string text = "version: 1\ndefault: {compressor: none}\n";
  const auto ok = ipc::encode(ipc::StrategyMsg{"job.yaml", text});
  const auto d = ipc::decode(ok);
  ASSERT_EQ(d.type, ipc::MsgType::kStrategy);
  EXPECT_EQ(std::get<ipc::StrategyMsg>(d.msg).source, "job.yaml");
  EXPECT_EQ(std::get<ipc::StrategyMsg>(d.msg).text, text);
  // Every truncation is caught.
  for (size_t cut = 1; cut < ok.size() - 16; ++cut) {
    auto b = ok;
    b.resize(ok.size() - cut);
    b[8] = static_cast<uint8_t>(b.size() - 16);
    b[9] = 0;
    EXPECT_NE(malformed(b).find("STRATEGY"), std::string::npos) << cut;
  }
  // A text length that disagrees with the bytes, and an empty text.
  auto b = ok;
  b[16 + 2 + 8] = static_cast<uint8_t>(text.size() - 1);  // u32 text_bytes after the source
  EXPECT_NE(malformed(b).find("trailing"), std::string::npos);
  EXPECT_NE(malformed(ipc::encode(ipc::StrategyMsg{"x", ""})).find("text_bytes 0"),
            std::string::npos);
  // Too large to fit one datagram: refused when encoding.
  EXPECT_THROW(ipc::encode(ipc::StrategyMsg{"x", std::string(ipc::kMaxStrategyBytes + 1, 'a')}),
               Error);
}

namespace {

TEST(Protocol, CtlRequestAndReplyRoundTripAndAreChecked) {
  const auto req = ipc::encode(ipc::CtlRequest{ipc::kCtlVersion, "strategy", "job-1"});
  const auto d = ipc::decode(req);
  ASSERT_EQ(d.type, ipc::MsgType::kCtlRequest);
  EXPECT_EQ(std::get<ipc::CtlRequest>(d.msg).ctl_version, ipc::kCtlVersion);
  EXPECT_EQ(std::get<ipc::CtlRequest>(d.msg).command, "strategy");
  EXPECT_EQ(std::get<ipc::CtlRequest>(d.msg).arg, "job-1");
  for (size_t cut = 1; cut < req.size() - 16; ++cut) {
    auto b = req;
    b.resize(req.size() - cut);
    b[8] = static_cast<uint8_t>(b.size() - 16);
    EXPECT_NE(malformed(b).find("CTL_REQUEST"), std::string::npos) << cut;
  }
  EXPECT_NE(malformed(ipc::encode(ipc::CtlRequest{1, "", ""})).find("empty command"),
            std::string::npos);
  // A gpu_profile report of several compressors fits (well above 1 KiB);
  // one byte more than the limit is refused naming the field.
  const std::string big(ipc::kMaxCtlArgBytes, 'r');
  EXPECT_GE(big.size(), 16u * 1024);
  EXPECT_EQ(std::get<ipc::CtlRequest>(
                ipc::decode(ipc::encode(ipc::CtlRequest{1, "gpu_profile", big})).msg)
                .arg,
            big);
  EXPECT_THROW(ipc::encode(ipc::CtlRequest{1, "gpu_profile", big + "r"}), Error);

  // A long answer is cut into parts that fit a datagram, the last flagged.
  std::string text(3 * ipc::kMaxCtlChunkBytes + 5, 'x');
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>('a' + i % 26);
  const auto parts = ipc::encode_ctl_reply(0, text);
  ASSERT_EQ(parts.size(), 4u);
  std::string joined;
  for (size_t i = 0; i < parts.size(); ++i) {
    EXPECT_LE(parts[i].size(), ipc::kMaxMessageBytes);
    const auto r = ipc::decode(parts[i]);
    ASSERT_EQ(r.type, ipc::MsgType::kCtlReply);
    const auto& m = std::get<ipc::CtlReply>(r.msg);
    EXPECT_EQ(m.last, i + 1 == parts.size());
    EXPECT_EQ(m.code, 0u);
    joined += m.data;
  }
  EXPECT_EQ(joined, text);
  const auto empty = ipc::encode_ctl_reply(7, "");
  ASSERT_EQ(empty.size(), 1u);
  EXPECT_TRUE(std::get<ipc::CtlReply>(ipc::decode(empty[0]).msg).last);
  auto bad = ipc::encode(ipc::CtlReply{0, true, "ok"});
  bad[16 + 4] = 2;  // the last flag
  EXPECT_NE(malformed(bad).find("last flag 2"), std::string::npos);
  bad = ipc::encode(ipc::CtlReply{0, true, "ok"});
  bad[16] = 99;  // the code
  EXPECT_NE(malformed(bad).find("error code 99"), std::string::npos);
}

}  // namespace
