/*
 * libbytecomp — the ByteComp thin client (C ABI).
 *
 * A training process links this library to hand its gradients to the node's
 * ByteComp daemon (bytecompd). The daemon sums each tensor over every process
 * of the job on the node (and, with a strategy, across nodes, compressing on
 * its own CPU cores) and writes the result back into every process's buffer.
 * The library has no heavy dependencies (no ZeroMQ, no YAML): it speaks the
 * control protocol over a Unix socket and maps the job's shared memory.
 *
 * Life of a client:
 *
 *   bytecomp_connect_options opts;
 *   bytecomp_connect_options_init(&opts);
 *   opts.job_id = "resnet50-run7"; opts.local_rank = r; opts.local_size = n;
 *   bytecomp_client* c;
 *   if (bytecomp_connect(&opts, &c) != BYTECOMP_OK) die(bytecomp_last_error());
 *   uint32_t t0, t1;                       // declare every tensor, same order
 *   bytecomp_declare_tensor(c, "fc.weight", 1000 * 2048, BYTECOMP_FLOAT32,
 *                           BYTECOMP_DEVICE_CPU, 0, &t0);   // in every rank
 *   bytecomp_declare_tensor(c, "fc.bias", 1000, BYTECOMP_FLOAT32,
 *                           BYTECOMP_DEVICE_CPU, 0, &t1);
 *   bytecomp_start(c, 30000);              // waits for all local ranks
 *   void* buf; uint64_t bytes;
 *   bytecomp_tensor_buffer(c, t0, &buf, &bytes);   // write gradients here
 *   for (uint64_t it = 0;; ++it) {
 *     ... fill buf ...
 *     bytecomp_handle h;
 *     bytecomp_push_pull(c, t0, it, &h);   // asynchronous
 *     bytecomp_wait(c, h, 10000);          // buf now holds the sum
 *   }
 *   bytecomp_close(c);
 *
 * Errors: every function returns a bytecomp_status. On failure the calling
 * thread's bytecomp_last_error() says what was wrong and what to do; the
 * message stays valid until the same thread calls into the library again.
 *
 * Thread-safety: all functions may be called from any thread at any time on
 * the same client, except bytecomp_close(), which must not race with other
 * calls on that client (it invalidates the handle). Several threads may wait
 * on different handles at once.
 *
 * Memory: a tensor's buffer lives in shared memory owned by the daemon. It is
 * valid from bytecomp_start() until bytecomp_close() (or until the job is
 * aborted and the client closed). Between bytecomp_push_pull() and the end of
 * its wait the daemon reads and writes the buffer: do not touch it then.
 *
 * Stability: this is ABI version 1. Later versions only add functions, enum
 * values and trailing fields of bytecomp_connect_options (whose struct_size
 * tells the library which fields the caller knows). Nothing is removed or
 * renumbered.
 */
#ifndef BYTECOMP_BYTECOMP_H_
#define BYTECOMP_BYTECOMP_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define BYTECOMP_API
#else
#define BYTECOMP_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this C ABI. bytecomp_abi_version() returns the library's; a
 * caller built against a newer header than the library it loads can check. */
#define BYTECOMP_ABI_VERSION 1u

/* Result of every call. Values 0..9 match bytecomp::ErrorCode. */
typedef enum bytecomp_status {
  BYTECOMP_OK = 0,
  BYTECOMP_ERR_INVALID_ARGUMENT = 1, /* bad argument: null, unknown tensor, wrong size */
  BYTECOMP_ERR_CONFIG = 2,           /* bad environment/configuration value */
  BYTECOMP_ERR_PROTOCOL = 3,         /* malformed message or shared memory from the daemon */
  BYTECOMP_ERR_TIMEOUT = 4,          /* the wait ran past its timeout; retry is allowed */
  BYTECOMP_ERR_PEER_LOST = 5,        /* another process of the job died */
  BYTECOMP_ERR_ABORTED = 6,          /* the job was aborted (the message says why) */
  BYTECOMP_ERR_UNAVAILABLE = 7,      /* daemon not running / connection to it lost */
  BYTECOMP_ERR_RESOURCE_EXHAUSTED = 8, /* shared memory or a daemon limit exhausted */
  BYTECOMP_ERR_INTERNAL = 9,         /* a bug: please report with the message */
  BYTECOMP_ERR_VERSION_MISMATCH = 10,/* library and daemon speak different protocols */
  BYTECOMP_ERR_STATE = 11,           /* call not allowed now (e.g. declare after start) */
  BYTECOMP_ERR_UNSUPPORTED = 12      /* not supported yet (e.g. GPU tensors) */
} bytecomp_status;

typedef enum bytecomp_dtype {
  BYTECOMP_FLOAT32 = 0,
  BYTECOMP_FLOAT64 = 1,
  BYTECOMP_INT32 = 2,
  BYTECOMP_INT64 = 3
} bytecomp_dtype;

typedef enum bytecomp_device_type {
  BYTECOMP_DEVICE_CPU = 0,
  BYTECOMP_DEVICE_CUDA = 1 /* refused with BYTECOMP_ERR_UNSUPPORTED for now */
} bytecomp_device_type;

typedef struct bytecomp_client bytecomp_client; /* opaque */

/* Identifies one push_pull. Never 0 for a valid handle. */
typedef uint64_t bytecomp_handle;

typedef struct bytecomp_connect_options {
  /* sizeof(bytecomp_connect_options) as the caller knows it; set by _init. */
  uint32_t struct_size;
  /* Daemon control socket. NULL: $BYTECOMP_SOCKET, else
   * "/run/bytecomp/bytecompd.sock". */
  const char* socket_path;
  /* Job identity shared by all processes of one training job: 1..128 chars
   * of [A-Za-z0-9._-]. Required. */
  const char* job_id;
  /* This process's rank among the job's processes on this node, and their
   * number. All local ranks must connect to the same daemon. */
  uint32_t local_rank;
  uint32_t local_size;
  /* This node's rank among the job's nodes, and their number. */
  uint32_t node_rank;
  uint32_t num_nodes;
  /* Bound on connecting and on each setup exchange with the daemon (ms). */
  uint32_t connect_timeout_ms;
  /* Daemon liveness: a wait fails with BYTECOMP_ERR_UNAVAILABLE ("bytecompd
   * ... not responding for N s") once the daemon's heartbeat in the job's
   * shared memory has not moved for this long (a stopped or hung daemon).
   * 0: $BYTECOMP_DAEMON_TIMEOUT_MS, else 5000. (Added after ABI version 1's
   * first release: struct_size tells whether a caller knows it.) */
  uint32_t daemon_timeout_ms;
} bytecomp_connect_options;

/* Fills defaults: struct_size, socket_path NULL, job_id NULL, local rank 0 of
 * 1, node rank 0 of 1, connect_timeout_ms 10000, daemon_timeout_ms 0. */
BYTECOMP_API void bytecomp_connect_options_init(bytecomp_connect_options* opts);

/* Connects to the daemon and joins (or creates) the job. Checks that the
 * library and the daemon speak the same protocol version. On success *out is
 * a client the caller must release with bytecomp_close(). */
BYTECOMP_API bytecomp_status bytecomp_connect(const bytecomp_connect_options* opts,
                                              bytecomp_client** out);

/* Declares the next tensor. Every local rank must declare the same tensors
 * (name, element count, dtype) in the same order; the first declared is the
 * first needed by the forward pass and gets the highest priority. Ids are
 * 0, 1, 2, ... in declaration order. Only before bytecomp_start(). Names are
 * 1..1024 bytes, unique within the job. device_index is ignored for CPU. */
BYTECOMP_API bytecomp_status bytecomp_declare_tensor(bytecomp_client* client,
                                                     const char* name, uint64_t count,
                                                     bytecomp_dtype dtype,
                                                     bytecomp_device_type device,
                                                     int32_t device_index,
                                                     uint32_t* out_tensor_id);

/* Ends declarations: sends them to the daemon and waits (at most timeout_ms)
 * until every local rank of the job has started with identical declarations
 * and the job's shared memory is mapped. After a failure the client can only
 * be closed. A job with num_nodes > 1 may return before every node joined:
 * its first push_pulls then wait for the other nodes (bounded by the
 * cluster's admission timeout; a refused admission aborts the job). */
BYTECOMP_API bytecomp_status bytecomp_start(bytecomp_client* client, uint32_t timeout_ms);

/* Added in ABI 1.1 (symbol version BYTECOMP_1.1). Sets this job's strategy
 * (the planner's YAML format, docs/strategy-format.md) for this job only,
 * instead of the daemon's configured default. Only before bytecomp_start();
 * a later call replaces an earlier one. Every local rank must pass the same
 * text (else bytecomp_start fails for all of them, naming the ranks); every
 * node of a multi-node job must too (else the coordinator refuses the job,
 * naming the nodes). The daemon checks it against the job's tensors at
 * bytecomp_start, which fails with the problem and `source_name` (e.g. the
 * file the text came from; NULL: "<client strategy>"). Text up to about
 * 63 KiB. An older bytecompd refuses it at bytecomp_start. */
BYTECOMP_API bytecomp_status bytecomp_set_strategy(bytecomp_client* client,
                                                   const char* yaml_text,
                                                   const char* source_name);

/* The id of a declared tensor by name. */
BYTECOMP_API bytecomp_status bytecomp_tensor_id(bytecomp_client* client, const char* name,
                                                uint32_t* out_tensor_id);

/* This process's shared-memory buffer of a tensor (after bytecomp_start()):
 * count * dtype-size bytes, 64-byte aligned. Place the gradient there. */
BYTECOMP_API bytecomp_status bytecomp_tensor_buffer(bytecomp_client* client,
                                                    uint32_t tensor_id, void** out_data,
                                                    uint64_t* out_bytes);

/* Starts summing the tensor's buffer over the job for `iteration`. All local
 * ranks must push the same tensor with the same iteration; iterations of a
 * tensor must increase. At most one push_pull per tensor may be outstanding
 * (not yet completed by bytecomp_wait()). */
BYTECOMP_API bytecomp_status bytecomp_push_pull(bytecomp_client* client, uint32_t tensor_id,
                                                uint64_t iteration,
                                                bytecomp_handle* out_handle);

/* Added in ABI 1.3 (symbol version BYTECOMP_1.3). The job's partition size
 * in bytes, once the daemon published it (a single-node job: from
 * bytecomp_start(); a multi-node job: once the daemon joined the cluster,
 * before its first round completes); *out_bytes is 0 before (not an error). */
BYTECOMP_API bytecomp_status bytecomp_partition_bytes(bytecomp_client* client,
                                                      uint64_t* out_bytes);

/* Added in ABI 1.5 (symbol version BYTECOMP_1.5). Tensor `tensor_id`'s own
 * partitions once the daemon published them (when bytecomp_partition_bytes
 * turns non-zero): *out_partition_bytes, the size of each (the last may be
 * shorter), and *out_partitions (may be NULL), how many. They are the job's
 * partition size for a tensor whose strategy option has `pieces: 1`, that
 * size cut into `pieces` slices (rounded down to a multiple of 64 bytes)
 * otherwise, fixed for the job (docs/gpu.md §4). Both 0 before (not an
 * error). A compressed push lays its payloads out by these. */
BYTECOMP_API bytecomp_status bytecomp_tensor_partitions(bytecomp_client* client,
                                                        uint32_t tensor_id,
                                                        uint64_t* out_partition_bytes,
                                                        uint32_t* out_partitions);

/* Added in ABI 1.3. As bytecomp_push_pull, but the buffer holds the gradient
 * already compressed by the caller (e.g. on its GPU, docs/gpu.md): for each
 * partition p (bytes [p * P, min((p + 1) * P, tensor bytes)) with P the
 * tensor's partition size from bytecomp_tensor_partitions, or, from a
 * library before ABI 1.5, bytecomp_partition_bytes, which is the same for a
 * tensor without `pieces`; it must be non-zero), that range starts with
 * the partition's payload in the CPU compressor library's wire format, of the
 * compressor of the strategy in force for the iteration, with the caller's own
 * error feedback. The daemon does not compress again; the result, as for
 * bytecomp_push_pull, is the dense aggregate in the buffer. All local ranks
 * push a round the same way; multi-node jobs accept it with one local rank
 * per node. A payload the daemon cannot use aborts the job with the reason. */
BYTECOMP_API bytecomp_status bytecomp_push_pull_compressed(bytecomp_client* client,
                                                           uint32_t tensor_id, uint64_t iteration,
                                                           bytecomp_handle* out_handle);

/* Added in ABI 1.4 (symbol version BYTECOMP_1.4). As
 * bytecomp_push_pull_compressed, but the first `dense_partitions` partitions
 * of the buffer hold the dense gradient, which the daemon compresses on its
 * CPU pool, and only the rest hold the caller's payloads: the strategy's
 * `cpu_share` executed (docs/gpu.md §4). dense_partitions must be below the
 * tensor's partition count (bytecomp_tensor_partitions; all dense is
 * bytecomp_push_pull) and equal to the daemon's rounding of the plan's
 * cpu_share (llround(cpu_share * partitions)), else the job fails naming
 * both. 0 is
 * bytecomp_push_pull_compressed. An older bytecompd fails the job (unknown
 * submit flags). */
BYTECOMP_API bytecomp_status bytecomp_push_pull_split(bytecomp_client* client, uint32_t tensor_id,
                                                      uint64_t iteration,
                                                      uint32_t dense_partitions,
                                                      bytecomp_handle* out_handle);

/* Added in ABI 1.2 (symbol version BYTECOMP_1.2). Starts a broadcast: the
 * first `nbytes` bytes of the tensor's buffer of global rank `root_rank`
 * (node_rank * local_size + local_rank) are copied, raw (any dtype, no
 * conversion), into every rank's buffer of the tensor; the rest of the
 * buffers stays as it is. The root's node sends them once, cut at the
 * cluster's partitions, to the parameter servers, which answer every other
 * node with them; on the node the daemon copies them between the local
 * ranks' shared memory. Every rank of the job must call it with the same
 * tensor, iteration, root_rank, nbytes and `tag` (a value of the caller's,
 * e.g. a hash of what travels); where they differ the job fails on every rank
 * with an error naming the values. Iterations and the one-operation-in-flight
 * rule are shared with bytecomp_push_pull on the same tensor (do not mix the
 * two on one tensor while one is in flight). Wait with bytecomp_wait(); the
 * root's buffer must stay untouched until then. nbytes may be 0 (the call
 * then only synchronises). An older bytecompd refuses it (the job fails). */
BYTECOMP_API bytecomp_status bytecomp_broadcast(bytecomp_client* client, uint32_t tensor_id,
                                                uint64_t iteration, uint32_t root_rank,
                                                uint64_t nbytes, uint64_t tag,
                                                bytecomp_handle* out_handle);

/* Added in ABI 1.2. Starts a barrier: its handle completes (bytecomp_wait)
 * once every rank of the job (every node: through the coordinator) has
 * called bytecomp_barrier as often. At most one barrier in flight per
 * client. A rank that closes or dies meanwhile fails it for everyone. */
BYTECOMP_API bytecomp_status bytecomp_barrier(bytecomp_client* client,
                                              bytecomp_handle* out_handle);

/* Waits at most timeout_ms (0: just look) for the push_pull (broadcast,
 * barrier) to finish. BYTECOMP_OK: the
 * buffer holds the result and the handle is released. BYTECOMP_ERR_TIMEOUT:
 * not finished yet, the handle stays valid (wait again). Any other error: the
 * operation failed and the handle is released. */
BYTECOMP_API bytecomp_status bytecomp_wait(bytecomp_client* client, bytecomp_handle handle,
                                           uint32_t timeout_ms);

/* Non-blocking: *out_done = 1 when the operation has finished (successfully
 * or not; bytecomp_wait() then returns at once with its result), else 0.
 * Never releases the handle. */
BYTECOMP_API bytecomp_status bytecomp_poll(bytecomp_client* client, bytecomp_handle handle,
                                           int* out_done);

/* Leaves the job and frees the client (NULL is accepted). Outstanding
 * operations fail; if other ranks still run, the daemon aborts the job for
 * them. The buffers become invalid. Always frees the client, even when it
 * returns an error (which then only reports how the job ended). */
BYTECOMP_API bytecomp_status bytecomp_close(bytecomp_client* client);

/* Message of the last failing call made by this thread ("" if none). */
BYTECOMP_API const char* bytecomp_last_error(void);

/* "BYTECOMP_ERR_TIMEOUT" etc.; "unknown" for values not listed. */
BYTECOMP_API const char* bytecomp_status_name(int status);

/* Bytes of one element of the dtype, 0 for unknown values. */
BYTECOMP_API uint32_t bytecomp_dtype_size(int dtype);

BYTECOMP_API uint32_t bytecomp_abi_version(void);
/* Library version, e.g. "0.1.0 (protocol 1)". */
BYTECOMP_API const char* bytecomp_version_string(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* BYTECOMP_BYTECOMP_H_ */
