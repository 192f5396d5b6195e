// The NCCL half of libbytecomp_gpu (bytecomp_gpu.h, "NCCL among the local
// ranks"): non-blocking communicators whose every wait is bounded and polls
// ncclCommGetAsyncError, so a failure or a dead peer ends in ncclCommAbort
// and an error, never a hang. Compiled as plain C++ against the CUDA runtime
// and NCCL headers; without NCCL every entry says so.
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "bytecomp/bytecomp_gpu.h"
#include "bytecomp_build_config.h"

namespace bytecomp::client_gpu {
bytecomp_status set_error(bytecomp_status s, std::string msg);  // gpu_abi.cc
}
using bytecomp::client_gpu::set_error;

#if BYTECOMP_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

static_assert(sizeof(ncclUniqueId) == BYTECOMP_GPU_NCCL_ID_BYTES);

struct bytecomp_gpu_nccl {
  ncclComm_t comm = nullptr;
  int nranks = 0, rank = 0, device = 0;
  bool aborted = false;
};

namespace {

using Clock = std::chrono::steady_clock;

bytecomp_status nccl_fail(bytecomp_gpu_nccl* c, bytecomp_status s, const std::string& what) {
  if (c && c->comm && !c->aborted) {
    ncclCommAbort(c->comm);  // wakes every rank's pending collective with an error
    c->aborted = true;
  }
  return set_error(s, what + " (communicator aborted)");
}

// Polls the communicator until `done()` or an error/timeout.
template <class Done>
bytecomp_status poll(bytecomp_gpu_nccl* c, uint32_t timeout_ms, const char* what, Done done) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->comm, &async);
    if (r != ncclSuccess) async = r;
    if (async != ncclSuccess && async != ncclInProgress)
      return nccl_fail(c, BYTECOMP_ERR_PEER_LOST,
                       std::string(what) + ": NCCL " + ncclGetErrorString(async) +
                           " (a local rank died or failed?)");
    if (async == ncclSuccess) {
      int d = done();
      if (d < 0) return nccl_fail(c, BYTECOMP_ERR_INTERNAL, std::string(what) + ": CUDA error");
      if (d > 0) return BYTECOMP_OK;
    }
    if (Clock::now() >= deadline)
      return nccl_fail(c, BYTECOMP_ERR_TIMEOUT,
                       std::string(what) + ": not done within " + std::to_string(timeout_ms) +
                           " ms (another local rank is stuck or gone)");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

bool usable(bytecomp_gpu_nccl* c, const char* what, bytecomp_status* s) {
  if (!c) { *s = set_error(BYTECOMP_ERR_INVALID_ARGUMENT, std::string(what) + ": null communicator"); return false; }
  if (c->aborted) { *s = set_error(BYTECOMP_ERR_ABORTED, std::string(what) + ": the communicator was aborted"); return false; }
  return true;
}

}  // namespace

extern "C" {

int bytecomp_gpu_nccl_built(void) { return 1; }

bytecomp_status bytecomp_gpu_nccl_unique_id(uint8_t out_id[BYTECOMP_GPU_NCCL_ID_BYTES]) {
  if (!out_id) return set_error(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_nccl_unique_id: null");
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    return set_error(BYTECOMP_ERR_UNAVAILABLE, std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  std::memcpy(out_id, &id, sizeof id);
  return BYTECOMP_OK;
}

bytecomp_status bytecomp_gpu_nccl_create(const uint8_t id[BYTECOMP_GPU_NCCL_ID_BYTES], int nranks,
                                         int rank, int device, uint32_t timeout_ms,
                                         bytecomp_gpu_nccl** out) {
  if (out) *out = nullptr;
  if (!id || !out || nranks < 1 || rank < 0 || rank >= nranks || device < 0)
    return set_error(BYTECOMP_ERR_INVALID_ARGUMENT,
                     "bytecomp_gpu_nccl_create: rank " + std::to_string(rank) + " of " +
                         std::to_string(nranks) + ", device " + std::to_string(device));
  *out = nullptr;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || device >= devices)
    return set_error(BYTECOMP_ERR_UNSUPPORTED, "bytecomp_gpu_nccl_create: CUDA device " +
                                                   std::to_string(device) + " not present (" +
                                                   std::to_string(devices) + " visible)");
  if (cudaSetDevice(device) != cudaSuccess)
    return set_error(BYTECOMP_ERR_UNAVAILABLE, "cudaSetDevice(" + std::to_string(device) + ")");
  auto* c = new bytecomp_gpu_nccl;
  c->nranks = nranks;
  c->rank = rank;
  c->device = device;
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // init and collectives return at once; poll() bounds the waits
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, nranks, uid, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    bytecomp_status s = set_error(BYTECOMP_ERR_UNAVAILABLE,
                                  std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r));
    if (c->comm) ncclCommAbort(c->comm);
    delete c;
    return s;
  }
  bytecomp_status s = poll(c, timeout_ms, "NCCL communicator init", [] { return 1; });
  if (s != BYTECOMP_OK) {
    delete c;  // aborted by poll
    return s;
  }
  *out = c;
  return BYTECOMP_OK;
}

bytecomp_status bytecomp_gpu_nccl_sum(bytecomp_gpu_nccl* c, float* buf, uint64_t count, int shard,
                                      void* stream) {
  bytecomp_status s;
  if (!usable(c, "bytecomp_gpu_nccl_sum", &s)) return s;
  auto st = static_cast<cudaStream_t>(stream);
  ncclResult_t r;
  if (shard) {
    if (count % static_cast<uint64_t>(c->nranks) != 0)
      return set_error(BYTECOMP_ERR_INVALID_ARGUMENT,
                       "bytecomp_gpu_nccl_sum: " + std::to_string(count) +
                           " elements do not split into " + std::to_string(c->nranks) + " shards");
    const uint64_t per = count / c->nranks;
    r = ncclReduceScatter(buf, buf + per * c->rank, per, ncclFloat32, ncclSum, c->comm, st);
  } else {
    r = ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, c->comm, st);
  }
  if (r != ncclSuccess && r != ncclInProgress)
    return nccl_fail(c, BYTECOMP_ERR_PEER_LOST, std::string("NCCL sum: ") + ncclGetErrorString(r));
  return BYTECOMP_OK;
}

bytecomp_status bytecomp_gpu_nccl_allgather(bytecomp_gpu_nccl* c, float* buf, uint64_t count,
                                            void* stream) {
  bytecomp_status s;
  if (!usable(c, "bytecomp_gpu_nccl_allgather", &s)) return s;
  if (count % static_cast<uint64_t>(c->nranks) != 0)
    return set_error(BYTECOMP_ERR_INVALID_ARGUMENT, "bytecomp_gpu_nccl_allgather: count not a multiple of the ranks");
  const uint64_t per = count / c->nranks;
  ncclResult_t r = ncclAllGather(buf + per * c->rank, buf, per, ncclFloat32, c->comm,
                                 static_cast<cudaStream_t>(stream));
  if (r != ncclSuccess && r != ncclInProgress)
    return nccl_fail(c, BYTECOMP_ERR_PEER_LOST, std::string("NCCL allgather: ") + ncclGetErrorString(r));
  return BYTECOMP_OK;
}

bytecomp_status bytecomp_gpu_nccl_wait(bytecomp_gpu_nccl* c, void* stream, uint32_t timeout_ms) {
  bytecomp_status s;
  if (!usable(c, "bytecomp_gpu_nccl_wait", &s)) return s;
  auto st = static_cast<cudaStream_t>(stream);
  return poll(c, timeout_ms, "NCCL collective", [st] {
    cudaError_t e = cudaStreamQuery(st);
    return e == cudaSuccess ? 1 : e == cudaErrorNotReady ? 0 : -1;
  });
}

void bytecomp_gpu_nccl_abort(bytecomp_gpu_nccl* c) {
  if (c && c->comm && !c->aborted) {
    ncclCommAbort(c->comm);
    c->aborted = true;
  }
}

void bytecomp_gpu_nccl_destroy(bytecomp_gpu_nccl* c) {
  if (!c) return;
  if (c->comm && !c->aborted) {
    // Bounded: a finalize that does not complete is aborted instead.
    const ncclResult_t r = ncclCommFinalize(c->comm);
    if (r == ncclSuccess || r == ncclInProgress)
      (void)poll(c, 10000, "NCCL finalize", [] { return 1; });  // aborts on error/timeout
    else
      bytecomp_gpu_nccl_abort(c);
    if (!c->aborted) ncclCommDestroy(c->comm);
  }
  delete c;
}

}  // extern "C"

#else  // !BYTECOMP_HAVE_NCCL

struct bytecomp_gpu_nccl {};

namespace {
bytecomp_status no_nccl(const char* what) {
  return set_error(BYTECOMP_ERR_UNSUPPORTED,
                   std::string(what) + ": libbytecomp_gpu was built without NCCL (configure with "
                                       "-Dnccl=enabled where the toolkit has NCCL)");
}
}  // namespace

extern "C" {
int bytecomp_gpu_nccl_built(void) { return 0; }
bytecomp_status bytecomp_gpu_nccl_unique_id(uint8_t*) { return no_nccl("bytecomp_gpu_nccl_unique_id"); }
bytecomp_status bytecomp_gpu_nccl_create(const uint8_t*, int, int, int, uint32_t, bytecomp_gpu_nccl** out) {
  if (out) *out = nullptr;
  return no_nccl("bytecomp_gpu_nccl_create");
}
bytecomp_status bytecomp_gpu_nccl_sum(bytecomp_gpu_nccl*, float*, uint64_t, int, void*) { return no_nccl("bytecomp_gpu_nccl_sum"); }
bytecomp_status bytecomp_gpu_nccl_allgather(bytecomp_gpu_nccl*, float*, uint64_t, void*) { return no_nccl("bytecomp_gpu_nccl_allgather"); }
bytecomp_status bytecomp_gpu_nccl_wait(bytecomp_gpu_nccl*, void*, uint32_t) { return no_nccl("bytecomp_gpu_nccl_wait"); }
void bytecomp_gpu_nccl_abort(bytecomp_gpu_nccl*) {}
void bytecomp_gpu_nccl_destroy(bytecomp_gpu_nccl*) {}
}  // extern "C"

#endif
