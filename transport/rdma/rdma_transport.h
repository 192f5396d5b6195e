// The RDMA backend (internal; reach it through make_transport("rdma", ...)).
//
// librdmacm sets up one RC queue pair per peer (address "rdma://host:port",
// the IP of an RDMA-capable interface; port 0 = ephemeral). On top of the
// shared core (wire header, validation, correlation, heartbeats, dispatch):
//   * eager path: messages whose header + payload fit rdma.eager_limit are
//     copied into a pre-registered send slot and sent with IBV_WR_SEND into
//     one of rdma.recv_buffers pre-posted, pre-registered receive slots;
//   * rendezvous path for larger ones: RTS (header) -> the receiver takes a
//     region from its registered pool and answers CTS (addr, rkey) -> the
//     sender RDMA-writes the payloads straight from the caller's memory
//     (registered once per Buffer owner, cached while that owner lives) with
//     immediate data naming the region -> the receiver hands the region to
//     handlers as Buffers, which return it to the pool when released;
//   * credit-based flow control: a sender never has more messages in flight
//     than the receiver has posted receive slots, so nothing is dropped by
//     the HCA (RNR) and queues stay bounded.
// Every control message is versioned and checked like the wire header.
//
// Threading: one loop thread owns every verbs and CM object; it sleeps in
// poll(2) on the CM event channel, the completion channel (ibv_req_notify_cq
// armed before each sleep) and an eventfd: no core is burned. Registered
// receive regions handed to users are returned from any thread through a
// locked free list.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"

namespace bytecomp::transport {

std::unique_ptr<Transport> make_rdma_transport(const TransportConfig& config);
// True when an RDMA device with an active port exists; else `reason` says
// what is missing.
bool rdma_device_usable(std::string* reason);

}  // namespace bytecomp::transport
