// The ZeroMQ backend (internal; reach it through make_transport("zmq", ...)).
//
// Sockets: one ROUTER bound to config.listen receives from every peer that
// connected to us and answers them by routing id; one DEALER per add_peer()
// peer (routing id = our node id) carries everything we send to that peer, so
// all traffic from us to one peer shares one ordered connection. CURVE (when
// enabled) secures both, with a ZAP handler that accepts only the cluster's
// key(s) and logs every refusal.
//
// Threading: ZeroMQ sockets are not thread-safe, so every socket use holds
// one mutex (io_mu_). One poll loop thread holds it except while it sleeps
// in poll(2) on the sockets' ZMQ_FDs, an eventfd (new sends, control
// commands) and the core's next timer deadline: no busy polling. A thread
// that queues a message while the loop sleeps takes the mutex and writes
// the message to ZeroMQ itself, sparing the loop a wake-up; when the loop
// is awake (mutex taken) it wakes it instead. ZeroMQ's io_threads do the
// socket I/O. Payloads go out zero-copy
// (zmq_msg_init_data holding a Buffer reference, released by ZeroMQ's I/O
// thread when sent), split into frames of at most max_frame_bytes; a
// received payload that came as one frame is handed over without a copy.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"

namespace bytecomp::transport {

std::unique_ptr<Transport> make_zmq_transport(const TransportConfig& config);

}  // namespace bytecomp::transport
