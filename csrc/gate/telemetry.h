#pragma once
// Part of the hook's native collective path; csrc/gate.cpp says why it exists.
//
// How long each op took from issue to completion, per group (and per point-to-point channel):
// the last kRing (sequence number, latency) pairs and how many completed. The sequence number
// is the op's on its group, the same on every member: the coordinator lines ranks up by it. Written on the communicator's thread when
// an op's future completes (or by the waiter of an op that has none), read by the hook's
// control thread on a `progress` query. Never calls into Python and never does I/O.

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace snapshotter {

class Telemetry {
 public:
  static constexpr size_t kRing = 64;
  using Clock = std::chrono::steady_clock;

  using Entry = std::pair<int64_t, double>;  // (seq, seconds)

  void record(const std::string& key, int64_t seq, Clock::time_point issued) {
    const double s = std::chrono::duration<double>(Clock::now() - issued).count();
    std::lock_guard<std::mutex> g(m_);
    auto& k = keys_[key];
    k.ring[k.done % kRing] = Entry(seq, s);
    ++k.done;
  }

  // key -> (completed, the latest (seq, seconds), in completion order)
  std::map<std::string, std::pair<int64_t, std::vector<Entry>>> latencies() {
    std::lock_guard<std::mutex> g(m_);
    std::map<std::string, std::pair<int64_t, std::vector<Entry>>> out;
    for (const auto& [key, k] : keys_) {
      const size_t n = std::min<size_t>(k.done, kRing);
      std::vector<Entry> v;
      v.reserve(n);
      for (size_t i = k.done - n; i < k.done; ++i) {
        v.push_back(k.ring[i % kRing]);
      }
      out.emplace(key, std::make_pair(static_cast<int64_t>(k.done), std::move(v)));
    }
    return out;
  }

  void forget(const std::string& key) {  // a destroyed group: its channels go with it
    std::lock_guard<std::mutex> g(m_);
    for (auto it = keys_.begin(); it != keys_.end();) {
      const bool mine = it->first == key || it->first.rfind(key + "|p2p:", 0) == 0;
      it = mine ? keys_.erase(it) : std::next(it);
    }
  }

 private:
  struct Key {
    std::array<Entry, kRing> ring{};
    size_t done = 0;
  };
  std::mutex m_;
  std::unordered_map<std::string, Key> keys_;
};

}  // namespace snapshotter
