// Planner inputs: model profile, cluster description, compression cost tables
// (paper section 4.3's empirical models), all loaded from versioned YAML with
// located errors (common/config.h).
//
// Thread-safety: plain values; const access from many threads is safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace bytecomp::planner {

struct TensorProfile {
  std::string name;
  uint64_t elements = 0;  // fp32 elements
  double gap_us = 0;      // compute time since the previous gradient was ready
};

// Gradient tensors in backward order (first = first gradient ready).
struct Profile {
  std::string model;
  std::vector<TensorProfile> tensors;
  // Forward pass time. Profiles of the paper's artifact do not carry it; when
  // absent it is taken as half the backward time (the usual 1:2 ratio), and
  // the report says so.
  std::optional<double> forward_us;

  double backward_us() const;
  double forward_or_default_us() const;
  static Profile load_file(const std::string& path);
  static Profile parse(std::string_view text, std::string name);
};

// cost(n) = max(floor_us, a_us + b_us_per_melem * n / 2^20)
struct LinearCost {
  double a_us = 0;
  double b_us_per_melem = 0;
  double floor_us = 0;
  double at(double elements) const;
};

struct Link {
  double gbps = 100;       // per port, gigabits per second
  double latency_us = 10;  // per collective step
  double bytes_per_us() const { return gbps * 1e3 / 8.0; }
};

struct Cluster {
  std::string name;
  int machines = 1;
  int gpus_per_machine = 1;
  Link intra{1200, 5};
  Link inter{100, 25};
  int cpu_cores = 8;             // per machine, available for compression
  double host_copy_gbps = 0;     // GPU<->host copy for CPU compression; 0 = free
  // Parameter servers: colocated with the workers (BytePS hybrid) or on
  // dedicated machines with their own NIC bandwidth.
  bool dedicated_servers = false;
  int servers = 0;               // 0 = one per machine (colocated)
  double server_gbps = 100;
  uint64_t partition_bytes = 0;  // 0 = tensors are not partitioned
  // CPU-only nodes running the CPU runtime (bytecompd): no GPU, no
  // intra-node link (gpus_per_machine, intra and host_copy_gbps are
  // ignored). Each partition of a tensor is summed over the node's local
  // ranks (`reduce`, one pool thread), compressed, pushed to the servers
  // that shard the tensor, summed there (non-additive compressors:
  // decompress every push and recompress the sum, on the node's cores when
  // the servers are colocated), pulled and decompressed. Pool work is
  // divided over `pool_threads`; the inter link is the node's NIC
  // (docs/planner.md, "Online planning").
  bool cpu_nodes = false;
  int pool_threads = 1;
  LinearCost reduce;             // one partition over the local ranks, one thread
  // CPU nodes whose cores are all taken by training (local ranks + pool
  // threads > cores): the daemon's and the colocated server's work then
  // takes cores from the backward pass, so it is placed on the compute
  // resource (which the backward pass yields to) instead of a spare pool.
  bool pool_shares_compute = false;
  // With pool_shares_compute: how long one microsecond of pool CPU work
  // holds the backward pass. On a saturated host the pool's work displaces
  // as much training work, spread over its cores; every node on the host
  // does its own, so the delay is nodes on the host / cores (2 for 4
  // emulated nodes on 2 cores, 1/8 for one node on 8).
  double pool_cost_scale = 1.0;
  // The comm stack's CPU (daemon: copies, sockets, sums; a colocated
  // server the same again for its share) per byte the node's NIC carries,
  // pushed or pulled: measured from the daemon's CPU time in the window.
  double comm_cpu_us_per_byte = 0;
  // The same for the bytes the daemons' ring sends and receives: the
  // daemon's own (no server takes part), where push/pull's includes the
  // colocated server's.
  double ring_comm_cpu_us_per_byte = 0;

  // The daemons' ring allreduce (inter: allreduce with none/fp16/bf16,
  // docs/daemon.md) against push/pull, measured on the emulated cluster
  // (scripts/bench-ring; docs/planner.md "Ring allreduce against
  // push/pull"). Per partition of P wire bytes on M nodes the ring takes
  // 2(M-1) steps of one segment (P/M) each, cut into chunks of at most
  // ring_chunk_bytes that are forwarded as they arrive (4 in flight per
  // neighbour); a step lasts the longer of its segment's bytes and one
  // chunk's bytes plus the per-hop latency (when a segment is one chunk,
  // the next step waits for it). ring_hop_us = 0 takes inter.latency_us.
  // The link shares are the fraction of the link's rate the scheme's
  // flows reach: one flow per direction for the ring; push/pull's flows
  // (one to each server, each server's fan-in of M-1 pushes and its
  // answers) reach 1 / (1 + ps_overhead + ps_fanin_overhead log2(M/2)).
  // The defaults (1, 0, 0) are the ideal links of the paper's testbeds;
  // the online planner uses the measured ones (planner/online.h).
  uint64_t ring_chunk_bytes = 1 << 20;
  double ring_hop_us = 0;
  double ring_link_share = 1.0;
  double ps_overhead = 0;
  double ps_fanin_overhead = 0;
  // Fraction of the link's rate push/pull reaches on `machines` nodes.
  double ps_link_share() const;
  // Time on the node's link of one ring allreduce of `bytes` wire bytes per
  // node (0 on one machine), and of a push or a pull (one of the two) of
  // `bytes` per node to sharded servers, `remote` of them crossing the NIC.
  double ring_us(double bytes) const;
  double ps_step_us(double bytes, double remote) const;

  int workers() const { return machines * gpus_per_machine; }
  static Cluster load_file(const std::string& path);
  static Cluster parse(std::string_view text, std::string name);
};


struct DeviceCost {
  LinearCost compress;
  LinearCost decompress;
};

struct CompressorCost {
  std::string name;
  std::map<std::string, std::string> params;
  bool error_feedback = false;
  // wire bytes(n) = fixed_bytes + bytes_per_element * n
  double bytes_per_element = 4;
  double fixed_bytes = 0;
  std::optional<DeviceCost> gpu;
  std::optional<DeviceCost> cpu;  // cost on ONE core; the pool divides work
  double wire_bytes(double elements) const {
    return fixed_bytes + bytes_per_element * elements;
  }
};

struct CostTable {
  std::string name;
  std::map<std::string, CompressorCost> compressors;

  const CompressorCost* find(const std::string& name) const;
  // A costs file (see docs/planner.md) or the paper's results file, whose
  // gpu_compression_cost_us_v100 and artifact_cost_model sections make the
  // V100 table.
  static CostTable load_file(const std::string& path);
  static CostTable parse(std::string_view text, std::string name);
  static CostTable from_paper_results(std::string_view text, std::string name);
  // Google Benchmark JSON of compress_bench (BM_Compress/<name>/<n>,
  // BM_Decompress/<name>/<n>): fits a + b*n per compressor for the CPU.
  static CostTable from_compress_bench_json(std::string_view json, std::string name);
  std::string to_yaml() const;
};

// Default wire size per element (bytes) for a compressor at given params
// (sparsifiers: values + 32-bit indices at `ratio`; randomk sends values only
// because its indices come from a shared seed).
double default_bytes_per_element(const std::string& compressor,
                                 const std::map<std::string, std::string>& params);

// "randomk:0.01", "qsgd:16", "efsignsgd", "dgc:ratio=0.01,momentum=0.9"
struct CompressorSpec {
  std::string name;
  std::map<std::string, std::string> params;
  static CompressorSpec parse(const std::string& text);  // throws Error
  std::string text() const;
};

}  // namespace bytecomp::planner
