#pragma once
// Part of the hook's native collective path; csrc/gate.cpp says why it exists.

#include "gate/gate.h"

namespace snapshotter {

// A c10d backend that counts every op on the gate and forwards it to the real backend it holds
// (`inner`), which the hook drops at a freeze and replaces at a resume; the ProcessGroup the
// script, DDP and DeviceMesh hold keeps this backend throughout.
class CountingBackend : public c10d::Backend {
 public:
  CountingBackend(
      int rank,
      int size,
      std::shared_ptr<Gate> gate,
      std::string key,
      std::string name)
      : c10d::Backend(rank, size),
        gate_(std::move(gate)),
        key_(std::move(key)),
        name_(std::move(name)) {}

  void setInner(intrusive_ptr<c10d::Backend> inner) {
    std::lock_guard<std::mutex> g(m_);
    inner_ = std::move(inner);
  }

  intrusive_ptr<c10d::Backend> getInner() {
    std::lock_guard<std::mutex> g(m_);
    return inner_;
  }

  // Drop the real backend (at a freeze, once nothing is in flight): every handle a caller
  // still holds lets go of its real work first, so the communicator's sockets close.
  void clearInner() {
    std::vector<intrusive_ptr<HandleWork>> live;
    {
      std::lock_guard<std::mutex> g(m_);
      for (auto& w : handles_) {
        auto h = w.lock();
        if (h) {
          live.push_back(std::move(h));
        }
      }
      handles_.clear();
    }
    for (auto& h : live) {
      h->release();
    }
    std::lock_guard<std::mutex> g(m_);
    inner_.reset();
  }

  bool destroyed() {
    std::lock_guard<std::mutex> g(m_);
    return destroyed_;
  }

  const std::string& key() const {
    return key_;
  }

  const std::string getBackendName() const override {
    return name_;
  }

  bool supportsSplitting() const override {
    return false;
  }

  bool supportsCoalescing() const override {
    return false;
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    auto inner = getInner();
    if (inner) {
      inner->setTimeout(timeout);
    }
  }

  void startCoalescing() override {
    refuse("the coalescing manager (_coalescing_manager / batch_isend_irecv)");
  }

  intrusive_ptr<c10d::Work> endCoalescing() override {
    refuse("the coalescing manager (_coalescing_manager / batch_isend_irecv)");
    return {};
  }

  void setSequenceNumberForGroup() override {
    current()->setSequenceNumberForGroup();
  }

  uint64_t getSequenceNumberForGroup() override {
    return current()->getSequenceNumberForGroup();
  }

  void shutdown() override {
    auto inner = forget();
    if (inner) {
      inner->shutdown();
    }
  }

  void abort() override {
    auto inner = forget();
    if (inner) {
      inner->abort();
    }
  }

  void setGroupUid(const std::string& uid) override {
    c10d::Backend::setGroupUid(uid);
    auto inner = getInner();
    if (inner) {
      inner->setGroupUid(uid);
    }
  }

#define SNAP_FORWARD(NAME, PARAMS, ARGS)                                          \
  intrusive_ptr<c10d::Work> NAME PARAMS override {                                \
    return issue(key_, [&](const intrusive_ptr<c10d::Backend>& b) { return b->NAME ARGS; }); \
  }

  SNAP_FORWARD(
      broadcast,
      (std::vector<at::Tensor> & t, const c10d::BroadcastOptions& o),
      (t, o))
  SNAP_FORWARD(
      allreduce,
      (std::vector<at::Tensor> & t, const c10d::AllreduceOptions& o),
      (t, o))
  SNAP_FORWARD(
      allreduce_sparse,
      (std::vector<at::Tensor> & t, const c10d::AllreduceOptions& o),
      (t, o))
  SNAP_FORWARD(
      allreduce_coalesced,
      (std::vector<at::Tensor> & t, const c10d::AllreduceCoalescedOptions& o),
      (t, o))
  SNAP_FORWARD(reduce, (std::vector<at::Tensor> & t, const c10d::ReduceOptions& o), (t, o))
  SNAP_FORWARD(
      allgather,
      (std::vector<std::vector<at::Tensor>> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      _allgather_base,
      (at::Tensor & out, at::Tensor& in, const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      allgather_coalesced,
      (std::vector<std::vector<at::Tensor>> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      allgather_into_tensor_coalesced,
      (std::vector<at::Tensor> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllgatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      gather,
      (std::vector<std::vector<at::Tensor>> & out,
       std::vector<at::Tensor>& in,
       const c10d::GatherOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      scatter,
      (std::vector<at::Tensor> & out,
       std::vector<std::vector<at::Tensor>>& in,
       const c10d::ScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      reduce_scatter,
      (std::vector<at::Tensor> & out,
       std::vector<std::vector<at::Tensor>>& in,
       const c10d::ReduceScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      _reduce_scatter_base,
      (at::Tensor & out, at::Tensor& in, const c10d::ReduceScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      reduce_scatter_tensor_coalesced,
      (std::vector<at::Tensor> & out,
       std::vector<at::Tensor>& in,
       const c10d::ReduceScatterOptions& o),
      (out, in, o))
  SNAP_FORWARD(
      alltoall_base,
      (at::Tensor & out,
       at::Tensor& in,
       std::vector<int64_t>& outSplit,
       std::vector<int64_t>& inSplit,
       const c10d::AllToAllOptions& o),
      (out, in, outSplit, inSplit, o))
  SNAP_FORWARD(
      alltoall,
      (std::vector<at::Tensor> & out,
       std::vector<at::Tensor>& in,
       const c10d::AllToAllOptions& o),
      (out, in, o))
  SNAP_FORWARD(barrier, (const c10d::BarrierOptions& o), (o))
#undef SNAP_FORWARD

  void monitoredBarrier(const c10d::BarrierOptions& o, bool waitAllRanks) override {
    gate_->enter(key_, false);  // synchronous: nothing stays in flight
    current()->monitoredBarrier(o, waitAllRanks);
  }

  // Point-to-point ops count per channel (peer and direction), not with the collectives: how
  // many a rank issues on a group differs from its peers'.
  intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return issue(channel(key_, getRank(), dst), [&](const intrusive_ptr<c10d::Backend>& b) {
      return b->send(t, dst, tag);
    });
  }

  intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return issue(channel(key_, src, getRank()), [&](const intrusive_ptr<c10d::Backend>& b) {
      return b->recv(t, src, tag);
    });
  }

  intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(
        false,
        "snapshotter: recv from any source is not supported on a resumable process group (a "
        "freeze could not tell which peer's message it is); name the source rank");
  }

 private:
  [[noreturn]] void refuse(const char* what) const {
    TORCH_CHECK(
        false,
        "snapshotter: ",
        what,
        " is not supported on a resumable process group; run without snapshotter or avoid it");
  }

  intrusive_ptr<c10d::Backend> current() {
    std::lock_guard<std::mutex> g(m_);
    TORCH_CHECK(
        inner_,
        "snapshotter: process group '",
        key_,
        "' has no communicator (torn down for a freeze, or destroyed)");
    return inner_;
  }

  intrusive_ptr<c10d::Backend> forget() {
    {
      std::lock_guard<std::mutex> g(m_);
      if (destroyed_) {
        return {};
      }
      destroyed_ = true;
    }
    gate_->removeGroup(key_);
    std::lock_guard<std::mutex> g(m_);
    auto inner = std::move(inner_);
    inner_.reset();
    return inner;
  }

  template <typename F>
  intrusive_ptr<c10d::Work> issue(const std::string& key, F&& call) {
    const int64_t seq = gate_->enter(key, true);
    const auto issued = Telemetry::Clock::now();
    intrusive_ptr<HandleWork> handle;
    try {
      auto work = call(current());
      handle = c10::make_intrusive<HandleWork>(std::move(work));
      if (const auto& t = gate_->telemetry()) {
        handle->timeCompletion(t, key, seq, issued);
      }
    } catch (...) {
      gate_->untrack();
      throw;
    }
    {
      std::lock_guard<std::mutex> g(m_);
      if (handles_.size() >= sweepAt_) {
        std::vector<c10::weak_intrusive_ptr<HandleWork>> live;
        for (auto& w : handles_) {
          if (!w.expired()) {
            live.push_back(std::move(w));
          }
        }
        handles_.swap(live);
        sweepAt_ = std::max<size_t>(kSweepAt, handles_.size() * 2);
      }
      handles_.emplace_back(handle);
    }
    gate_->track(handle);
    return handle;
  }

  std::shared_ptr<Gate> gate_;
  const std::string key_;
  const std::string name_;
  std::mutex m_;
  intrusive_ptr<c10d::Backend> inner_;
  std::vector<c10::weak_intrusive_ptr<HandleWork>> handles_;
  size_t sweepAt_ = kSweepAt;
  bool destroyed_ = false;
};

}  // namespace snapshotter
