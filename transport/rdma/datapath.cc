// Send and receive: eager sends through registered slots, rendezvous
// (RTS/CTS + RDMA write) for larger messages, control messages and credit
// returns, work completions.
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "transport/rdma/rdma_transport_impl.h"

namespace bytecomp::transport::rdma {

void RdmaTransport::post_recv(Conn& c, uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(c.recv->slot(slot)), static_cast<uint32_t>(c.recv->slot_bytes),
              c.recv->mr->lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(c.serial, kWrRecv, slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (ibv_post_recv(c.id->qp, &wr, &bad) != 0)
    BC_LOG(LogRdma(), kError) << "node " << self() << ": " << errno_text("ibv_post_recv");
}

bool RdmaTransport::post_ctl(Conn& c, const Ctl& ctl_in, const std::vector<std::byte>& header,
                             const std::vector<Buffer>& payloads, WrKind kind) {
  if (c.send->free_slots.empty()) return false;
  uint32_t slot = c.send->free_slots.back();
  c.send->free_slots.pop_back();
  Ctl ctl = ctl_in;
  ctl.credits = static_cast<uint16_t>(std::min(c.credits_to_return, 0xFFFF));
  c.credits_to_return -= ctl.credits;
  std::byte* p = c.send->slot(slot);
  encode_ctl(ctl, p);
  size_t off = sizeof ctl;
  if (!header.empty()) std::memcpy(p + off, header.data(), header.size());
  off += header.size();
  for (const Buffer& b : payloads) {
    if (b.size()) std::memcpy(p + off, b.data(), b.size());
    off += b.size();
  }
  ibv_sge sge{reinterpret_cast<uintptr_t>(p), static_cast<uint32_t>(off), c.send->mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id(c.serial, kind, slot);
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (ibv_post_send(c.id->qp, &wr, &bad) != 0) {
    BC_LOG(LogRdma(), kError) << "node " << self() << ": " << errno_text("ibv_post_send");
    c.send->free_slots.push_back(slot);
    c.credits_to_return += ctl.credits;
    return false;
  }
  --c.send_credits;
  return true;
}

void RdmaTransport::return_credits(Conn& c, bool force) {
  // Without outgoing traffic to carry them, report freed receives once half
  // the window is back (or when asked).
  if (c.state != ConnState::kReady || c.credits_to_return == 0) return;
  if (!force && c.credits_to_return < static_cast<int>(config().rdma.recv_buffers / 2)) return;
  if (c.send_credits <= 0) return;  // the reserved credit is this message's
  Ctl ctl;
  ctl.op = static_cast<uint8_t>(Op::kCredit);
  post_ctl(c, ctl, {}, {});
}

// 1: handed to the HCA (eager) or rendezvous started; 0: wait for credits or
// slots; -1: failed (completed).
int RdmaTransport::try_send(Conn& c, Outgoing& out) {
  const uint64_t total = out.header.total_payload_bytes();
  std::vector<std::byte> header = wire::encode(out.header);
  const bool eager = total <= config().rdma.eager_limit &&
                     sizeof(Ctl) + header.size() + total <= c.send->slot_bytes;
  // One credit stays reserved for credit returns.
  if (c.send_credits <= kReservedCredits || c.send->free_slots.empty()) return 0;
  if (eager) {
    Ctl ctl;
    ctl.op = static_cast<uint8_t>(Op::kEager);
    if (!post_ctl(c, ctl, header, out.payloads, kWrSend)) return 0;
    // The bytes were copied into the slot: release the caller's buffers now,
    // report completion when the HCA finished the send (handle_wc).
    SendingRdv rdv;
    rdv.out = std::move(out);
    rdv.out.payloads.clear();
    c.sending.emplace(next_rdv_++ | kEagerBit, std::move(rdv));
    return 1;
  }
  // Rendezvous: register payload memory now so the write can start on CTS.
  SendingRdv rdv;
  for (const Buffer& b : out.payloads) {
    if (b.empty()) {
      rdv.mrs.push_back(nullptr);
      continue;
    }
    std::string error;
    ibv_mr* mr = regcache_->get(b, error);
    if (!mr) {
      for (ibv_mr* m : rdv.mrs)
        if (m) regcache_->hold(m, -1);
      complete_send(out, Status(ErrorCode::kResourceExhausted, error));
      return -1;
    }
    regcache_->hold(mr, +1);
    rdv.mrs.push_back(mr);
  }
  uint64_t id = next_rdv_++;
  Ctl ctl;
  ctl.op = static_cast<uint8_t>(Op::kRts);
  ctl.rdv_id = id;
  ctl.length = total;
  if (!post_ctl(c, ctl, header, {})) {
    for (ibv_mr* m : rdv.mrs)
      if (m) regcache_->hold(m, -1);
    return 0;
  }
  rdv.out = std::move(out);
  c.sending.emplace(id, std::move(rdv));
  return 1;
}

void RdmaTransport::flush(Conn& c) {
  if (c.state != ConnState::kReady) return;
  while (!c.fifo.empty()) {
    int r = try_send(c, c.fifo.front());
    if (r == 0) break;
    c.fifo.pop_front();
  }
  return_credits(c, false);
}

void RdmaTransport::route_outgoing() {
  Outgoing out;
  while (pop_outgoing(out)) {
    auto it = by_node_.find(out.to);
    Conn* c = it == by_node_.end() ? nullptr : conn_by_serial(it->second);
    if (!c) {
      complete_send(out, Status(ErrorCode::kUnavailable,
                                "no connection to node " + std::to_string(out.to) +
                                    " (not added with add_peer and not connected to us)"));
      continue;
    }
    c->fifo.push_back(std::move(out));
  }
  for (auto& [serial, c] : conns_) flush(*c);
}

void RdmaTransport::on_recv(Conn& c, const std::byte* data, size_t len) {
  const std::string origin = "node " + std::to_string(c.node) + " (rdma)";
  Ctl ctl;
  if (std::string error; !decode_ctl(data, len, ctl, error)) {
    log_malformed(origin, error);
    return;
  }
  c.send_credits += ctl.credits;
  const std::byte* rest = data + sizeof ctl;
  size_t rest_len = len - sizeof ctl;
  auto decode_header = [&](wire::WireHeader& h, size_t& header_len) {
    std::string error;
    if (!wire_header_bytes(rest, rest_len, header_len, error)) {
      log_malformed(origin, error);
      return false;
    }
    if (!wire::decode({rest, header_len}, limits(), h, error)) {
      log_malformed(origin, error);
      return false;
    }
    if (h.src != c.node || h.dst != self()) {
      log_malformed(origin, "header names source " + std::to_string(h.src) + " and destination " +
                                std::to_string(h.dst));
      return false;
    }
    return true;
  };
  switch (static_cast<Op>(ctl.op)) {
    case Op::kCredit:
      note_alive(c.node);
      return;
    case Op::kEager: {
      wire::WireHeader h;
      size_t hl = 0;
      if (!decode_header(h, hl)) return;
      if (h.total_payload_bytes() != rest_len - hl) {
        log_malformed(origin, "eager message carries " + std::to_string(rest_len - hl) +
                                  " payload bytes, header declares " + std::to_string(h.total_payload_bytes()));
        return;
      }
      std::vector<Buffer> payloads;
      const std::byte* p = rest + hl;
      for (uint64_t s : h.payload_sizes) {
        payloads.push_back(s ? Buffer::copy_of(p, s) : Buffer());
        p += s;
      }
      on_received(std::move(h), std::move(payloads));
      return;
    }
    case Op::kRts: {
      wire::WireHeader h;
      size_t hl = 0;
      if (!decode_header(h, hl)) return;
      note_alive(c.node);
      Ctl reply;
      reply.rdv_id = ctl.rdv_id;
      std::string error;
      std::optional<RegisteredPool::Region> region;
      if (h.total_payload_bytes() != ctl.length || ctl.length == 0) {
        log_malformed(origin, "RTS length " + std::to_string(ctl.length) + " disagrees with its header");
        error = "bad RTS";
      } else {
        region = pool_->take(ctl.length, error);
      }
      if (!region) {
        reply.op = static_cast<uint8_t>(Op::kNack);
      } else {
        uint32_t slot = c.next_slot++ & 0xFFFFFF;
        if (slot == 0) slot = c.next_slot++ & 0xFFFFFF;
        c.receiving[slot] = ReceivingRdv{std::move(h), *region};
        reply.op = static_cast<uint8_t>(Op::kCts);
        reply.addr = reinterpret_cast<uintptr_t>(region->mem);
        reply.rkey = region->mr->rkey;
        reply.slot = slot;
        reply.length = ctl.length;
      }
      // CTS/NACK use the reserved credit if need be: the peer is waiting.
      if (!post_ctl(c, reply, {}, {}))
        BC_LOG(LogRdma(), kError) << "node " << self() << ": no send slot for CTS to node " << c.node;
      return;
    }
    case Op::kCts:
    case Op::kNack: {
      auto it = c.sending.find(ctl.rdv_id);
      if (it == c.sending.end() || it->second.writing) {
        log_malformed(origin, "CTS/NACK for unknown rendezvous " + std::to_string(ctl.rdv_id));
        return;
      }
      SendingRdv& rdv = it->second;
      if (static_cast<Op>(ctl.op) == Op::kNack) {
        for (ibv_mr* m : rdv.mrs)
          if (m) regcache_->hold(m, -1);
        complete_send(rdv.out, Status(ErrorCode::kResourceExhausted,
                                      "node " + std::to_string(c.node) + " could not take a " +
                                          std::to_string(rdv.out.header.total_payload_bytes()) + "-byte message"));
        c.sending.erase(it);
        return;
      }
      if (ctl.length != rdv.out.header.total_payload_bytes()) {
        log_malformed(origin, "CTS length " + std::to_string(ctl.length) + " for a " +
                                  std::to_string(rdv.out.header.total_payload_bytes()) + "-byte message");
        return;
      }
      // RDMA-write the payloads back to back, in frames, the last one with
      // the receiver's slot as immediate data.
      std::vector<ibv_send_wr> wrs;
      std::vector<ibv_sge> sges;
      const uint64_t frame = config().max_frame_bytes;
      size_t frames = 0;
      for (const Buffer& b : rdv.out.payloads) frames += wire::frame_count(b.size(), frame);
      wrs.resize(frames);
      sges.resize(frames);
      uint64_t remote = ctl.addr;
      size_t k = 0;
      for (size_t i = 0; i < rdv.out.payloads.size(); ++i) {
        const Buffer& b = rdv.out.payloads[i];
        for (uint64_t off = 0; off < b.size(); off += frame, ++k) {
          uint32_t len32 = static_cast<uint32_t>(std::min<uint64_t>(frame, b.size() - off));
          sges[k] = {reinterpret_cast<uintptr_t>(b.data() + off), len32, rdv.mrs[i]->lkey};
          ibv_send_wr& w = wrs[k];
          w = {};
          w.wr_id = wr_id(c.serial, kWrWrite, 0);
          w.sg_list = &sges[k];
          w.num_sge = 1;
          w.opcode = IBV_WR_RDMA_WRITE;
          w.wr.rdma.remote_addr = remote;
          w.wr.rdma.rkey = ctl.rkey;
          remote += len32;
          if (k > 0) wrs[k - 1].next = &w;
        }
      }
      ibv_send_wr& last = wrs.back();
      last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      last.imm_data = htonl(ctl.slot);
      last.send_flags = IBV_SEND_SIGNALED;
      last.wr_id = wr_id(c.serial, kWrWrite, static_cast<uint32_t>(ctl.rdv_id & 0xFFFFFF));
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(c.id->qp, wrs.data(), &bad) != 0) {
        for (ibv_mr* m : rdv.mrs)
          if (m) regcache_->hold(m, -1);
        complete_send(rdv.out, Status(ErrorCode::kInternal, errno_text("ibv_post_send (RDMA write)")));
        c.sending.erase(it);
        return;
      }
      --c.send_credits;  // the write-with-immediate consumes one receive
      rdv.writing = true;
      return;
    }
  }
  log_malformed(origin, "unknown control op " + std::to_string(ctl.op));
}

void RdmaTransport::on_write_imm(Conn& c, uint32_t slot) {
  auto it = c.receiving.find(slot);
  if (it == c.receiving.end()) {
    log_malformed("node " + std::to_string(c.node) + " (rdma)", "RDMA write for unknown region " +
                                                                    std::to_string(slot));
    return;
  }
  ReceivingRdv rdv = std::move(it->second);
  c.receiving.erase(it);
  Buffer whole = pool_->wrap(rdv.region, rdv.header.total_payload_bytes());
  std::vector<Buffer> payloads;
  size_t off = 0;
  for (uint64_t s : rdv.header.payload_sizes) {
    payloads.push_back(s ? whole.slice(off, s) : Buffer());
    off += s;
  }
  on_received(std::move(rdv.header), std::move(payloads));
}

void RdmaTransport::handle_wc(const ibv_wc& wc) {
  Conn* c = conn_by_serial(wr_serial(wc.wr_id));
  if (!c) return;  // flushed work of a closed connection
  const WrKind kind = wr_kind(wc.wr_id);
  const uint32_t index = wr_index(wc.wr_id);
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR)
      BC_LOG(LogRdma(), kWarn) << "node " << self() << ": work completion from node " << c->node << ": "
                               << ibv_wc_status_str(wc.status);
    // The QP is in error: everything on it is lost. The heartbeat bound
    // reports the peer; rebuild happens through backend_peer_lost().
    if (kind == kWrSend || kind == kWrCtl) c->send->free_slots.push_back(index);
    return;
  }
  switch (kind) {
    case kWrRecv: {
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        on_write_imm(*c, ntohl(wc.imm_data));
      } else {
        on_recv(*c, c->recv->slot(index), wc.byte_len);
      }
      // on_*() may have closed the connection.
      if ((c = conn_by_serial(wr_serial(wc.wr_id))) != nullptr) {
        post_recv(*c, index);
        c->credits_to_return++;
      }
      break;
    }
    case kWrCtl:
      c->send->free_slots.push_back(index);
      break;
    case kWrSend: {
      c->send->free_slots.push_back(index);
      // Eager sends complete in order of posting (RC, one QP).
      for (auto it = c->sending.begin(); it != c->sending.end(); ++it) {
        if (it->first & kEagerBit) {
          complete_send(it->second.out, Status());
          c->sending.erase(it);
          break;
        }
      }
      break;
    }
    case kWrWrite: {
      for (auto it = c->sending.begin(); it != c->sending.end(); ++it) {
        if (!(it->first & kEagerBit) && it->second.writing && (it->first & 0xFFFFFF) == index) {
          for (ibv_mr* m : it->second.mrs)
            if (m) regcache_->hold(m, -1);
          complete_send(it->second.out, Status());
          c->sending.erase(it);
          break;
        }
      }
      break;
    }
  }
  if ((c = conn_by_serial(wr_serial(wc.wr_id))) != nullptr) flush(*c);
}

void RdmaTransport::handle_completions() {
  ibv_cq* cq = nullptr;
  void* ctx = nullptr;
  while (ibv_get_cq_event(comp_channel_, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
  // Re-arm before draining so a completion arriving meanwhile wakes us.
  ibv_req_notify_cq(cq_, 0);
  ibv_wc wcs[64];
  for (;;) {
    int n = ibv_poll_cq(cq_, 64, wcs);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) handle_wc(wcs[i]);
  }
}

}  // namespace bytecomp::transport::rdma
