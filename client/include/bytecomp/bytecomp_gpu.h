/*
 * libbytecomp_gpu — ByteComp's GPU compression in the training process
 * (issue 27; the paper's GPU placement). A separate library from the thin
 * client (libbytecomp stays free of compression): it wraps the CUDA
 * compressors of compress/cuda/, which write the same self-describing wire
 * format as the CPU library, so a buffer compressed here decompresses with
 * the daemon's or server's CPU compressors and the other way round.
 *
 *   bytecomp_gpu_compressor* c;
 *   if (bytecomp_gpu_compressor_create("efsignsgd", n, &c) != BYTECOMP_OK) ...
 *   uint64_t cap; bytecomp_gpu_max_compressed_bytes(c, &cap);  // device buffer
 *   uint64_t len;
 *   bytecomp_gpu_compress(c, dev_grad, dev_out, cap, it, seed, stream, &len);
 *   ... dev_out[0, len) -> shared memory / the wire ...
 *   bytecomp_gpu_decompress(c, dev_in, len, dev_grad, 0, it, seed, stream);
 *   bytecomp_gpu_compressor_destroy(c);
 *
 * Tensors are float32 device pointers on the current CUDA device; the
 * compressed buffers are device memory on the same device (8-byte aligned
 * for compress). `stream` is a cudaStream_t (NULL: the legacy default
 * stream); the calls order their work on it and return without waiting for
 * the GPU, except where compress/cuda/cuda.h says (dgc's compress; every
 * decompress reads the header once).
 *
 * Errors: bytecomp_status values of bytecomp.h; the message of the calling
 * thread's last failure is bytecomp_gpu_last_error(). Built without CUDA,
 * or on a machine without a GPU, create() fails with
 * BYTECOMP_ERR_UNSUPPORTED and says which.
 *
 * Thread-safety: a compressor is one tensor's (it holds the tensor's
 * error-feedback state): its calls must be ordered by the caller; distinct
 * compressors may be used from any threads at once.
 */
#ifndef BYTECOMP_BYTECOMP_GPU_H_
#define BYTECOMP_BYTECOMP_GPU_H_

#include <stdint.h>

#include "bytecomp/bytecomp.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bytecomp_gpu_compressor bytecomp_gpu_compressor; /* opaque */

/* 1 when this library was built with the CUDA kernels; *out_devices: the
 * CUDA devices visible now (0 without a driver or GPU). */
BYTECOMP_API int bytecomp_gpu_built(int* out_devices);

/* 1 when `name` (a compressor name: "efsignsgd", "topk", ...) has CUDA
 * kernels in this build. */
BYTECOMP_API int bytecomp_gpu_supported(const char* name);

/* A compressor for one float32 tensor of `count` elements on the current
 * device, from a spec as the strategy writes it ("topk:0.01",
 * "qsgd:levels=16"). Allocates its state (residual, workspace) once. */
BYTECOMP_API bytecomp_status bytecomp_gpu_compressor_create(const char* spec, uint64_t count,
                                                            bytecomp_gpu_compressor** out);

/* The same compressor ABI over the CPU library on host pointers (`stream`
 * ignored): the stand-in for the CUDA compressors where there is no GPU
 * (host tests of the client-compressed path; same wire format, bit for bit
 * what the daemon's CPU pool computes). Works in every build. */
BYTECOMP_API bytecomp_status bytecomp_gpu_compressor_create_host(const char* spec, uint64_t count,
                                                                 bytecomp_gpu_compressor** out);

/* The shared seed the daemon compresses partition `partition` of tensor
 * `tensor_id` of job `job` with (planner/strategy/partition.h): a client
 * compressing the partition itself passes it, so seeded compressors
 * (randomk) pick the same elements as a daemon on another node would. */
BYTECOMP_API uint64_t bytecomp_gpu_partition_seed(const char* job, uint32_t tensor_id,
                                                  uint32_t partition);

BYTECOMP_API bytecomp_status bytecomp_gpu_max_compressed_bytes(bytecomp_gpu_compressor* c,
                                                               uint64_t* out_bytes);

BYTECOMP_API bytecomp_status bytecomp_gpu_compress(bytecomp_gpu_compressor* c,
                                                   const float* device_in, void* device_out,
                                                   uint64_t out_capacity, uint64_t iteration,
                                                   uint64_t shared_seed, void* stream,
                                                   uint64_t* out_bytes);

/* Decodes `in_bytes` bytes at device_in into device_out (count elements);
 * accumulate != 0 adds to its contents. A malformed buffer fails with
 * BYTECOMP_ERR_PROTOCOL before anything is written. */
BYTECOMP_API bytecomp_status bytecomp_gpu_decompress(bytecomp_gpu_compressor* c,
                                                     const void* device_in, uint64_t in_bytes,
                                                     float* device_out, int accumulate,
                                                     uint64_t iteration, uint64_t shared_seed,
                                                     void* stream);

/* NULL is accepted. */
BYTECOMP_API void bytecomp_gpu_compressor_destroy(bytecomp_gpu_compressor* c);

BYTECOMP_API const char* bytecomp_gpu_last_error(void);

/* --- NCCL among the local ranks (docs/daemon.md, "Intra-node on GPUs") -------
 * One communicator per job among the local ranks of a node, created at start:
 * local rank 0 makes the id, the job's broadcast (bytecomp_broadcast) carries
 * its 128 bytes to the others, each creates its communicator. Every wait is
 * bounded: on any NCCL error or timeout the communicator is aborted
 * (ncclCommAbort), so a dead local rank never hangs the others, and the call
 * fails with BYTECOMP_ERR_PEER_LOST (NCCL error) or BYTECOMP_ERR_TIMEOUT.
 * An aborted communicator only accepts destroy. Built without NCCL, every
 * call fails with BYTECOMP_ERR_UNSUPPORTED. */
#define BYTECOMP_GPU_NCCL_ID_BYTES 128
typedef struct bytecomp_gpu_nccl bytecomp_gpu_nccl; /* opaque */

/* 1 when built with NCCL. */
BYTECOMP_API int bytecomp_gpu_nccl_built(void);
BYTECOMP_API bytecomp_status bytecomp_gpu_nccl_unique_id(uint8_t out_id[BYTECOMP_GPU_NCCL_ID_BYTES]);
/* Joins the communicator of `id` as `rank` of `nranks` on CUDA device
 * `device`, waiting at most timeout_ms for every rank. */
BYTECOMP_API bytecomp_status bytecomp_gpu_nccl_create(const uint8_t id[BYTECOMP_GPU_NCCL_ID_BYTES],
                                                      int nranks, int rank, int device,
                                                      uint32_t timeout_ms,
                                                      bytecomp_gpu_nccl** out);
/* Enqueues an in-place float32 sum of `count` elements on `stream`; with
 * shard != 0 a reduce-scatter instead: rank r's sum of elements
 * [r*count/nranks, (r+1)*count/nranks) lands at that offset (count must be
 * a multiple of nranks). Does not wait. */
BYTECOMP_API bytecomp_status bytecomp_gpu_nccl_sum(bytecomp_gpu_nccl* c, float* device_buf,
                                                   uint64_t count, int shard, void* stream);
/* In-place allgather of the shards of a reduce-scatter (the way back). */
BYTECOMP_API bytecomp_status bytecomp_gpu_nccl_allgather(bytecomp_gpu_nccl* c, float* device_buf,
                                                         uint64_t count, void* stream);
/* Waits (at most timeout_ms) until `stream` has finished, watching the
 * communicator's asynchronous errors; aborts it on error or timeout. */
BYTECOMP_API bytecomp_status bytecomp_gpu_nccl_wait(bytecomp_gpu_nccl* c, void* stream,
                                                    uint32_t timeout_ms);
/* Aborts now (another rank failed: the caller learnt it from the daemon). */
BYTECOMP_API void bytecomp_gpu_nccl_abort(bytecomp_gpu_nccl* c);
/* Finalizes (or, after an abort, just frees) the communicator. NULL ok. */
BYTECOMP_API void bytecomp_gpu_nccl_destroy(bytecomp_gpu_nccl* c);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* BYTECOMP_BYTECOMP_GPU_H_ */
