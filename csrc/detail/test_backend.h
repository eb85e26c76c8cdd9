// TestBackend: a Backend decorator for tests of the host and sim backends. It injects failures into any
// backend call, simulates asynchronous streams' events (recorded events complete only when the test says so,
// or when the allocator waits for them), and simulates CUDA graph capture per stream. The allocator's
// failure, stream and capture logic is thereby testable on real host memory; the cuda backend gets the same
// coverage from the emulated driver (tests/fakecuda).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "../backend.h"

namespace vmalloc::detail {

class VMALLOC_API TestBackend final : public Backend {
 public:
  explicit TestBackend(std::unique_ptr<Backend> inner);

  // Calls are named reserve, release_reservation, create_chunk, release_chunk, map, unmap, set_access,
  // record_event, event_done, event_synchronize, synchronize, capturing. The `nth` call of `op` from now on (1 = the
  // next) fails, and every later one unless `once`. create_chunk failures are out-of-memory unless
  // `out_of_memory` is false. Throws std::invalid_argument for an unknown op.
  void fail(const std::string& op, std::size_t nth, bool once, bool out_of_memory = true);
  void clear_faults();
  // Calls made so far, per op (failed ones included).
  std::map<std::string, std::size_t> calls() const;
  std::size_t faults_fired() const;

  void set_capturing(Stream stream, bool capturing);
  // Completes every event recorded so far on `stream`.
  void complete(Stream stream);
  void complete_all();
  // Events recorded and not completed, per stream.
  std::map<Stream, std::size_t> outstanding() const;
  // Host waits: event_synchronize of an event not yet complete, and every synchronize (the test backend
  // cannot tell whether work queued without an event has run).
  std::size_t host_waits() const;

  const char* name() const override { return inner_->name(); }
  std::size_t granularity() const override { return inner_->granularity(); }
  std::size_t total_memory() const override { return inner_->total_memory(); }
  bool host_accessible() const override { return inner_->host_accessible(); }
  std::uintptr_t reserve(std::size_t bytes) override;
  void release_reservation(std::uintptr_t base, std::size_t bytes) override;
  ChunkHandle create_chunk(std::size_t bytes) override;
  void release_chunk(ChunkHandle chunk, std::size_t bytes) override;
  void map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk, std::size_t offset) override;
  bool maps_at_offsets() override { return inner_->maps_at_offsets(); }
  void unmap(std::uintptr_t addr, std::size_t bytes) override;
  void set_access(std::uintptr_t addr, std::size_t bytes) override;
  Event record_event(Stream stream) override;
  bool event_done(Event event) override;
  void event_synchronize(Event event) override;
  void release_event(Event event) noexcept override;
  void synchronize() override;  // completes every stream's events; always a host wait
  bool capturing(Stream stream) override;

 private:
  struct Fault {
    std::size_t at;  // fails when the op's call count reaches this
    bool once;
    bool out_of_memory;
  };
  struct SimEvent {
    Stream stream;
    std::uint64_t position;  // the stream's position when recorded
  };
  void maybe_fail(const char* op);  // counts the call; throws if a fault is due

  std::unique_ptr<Backend> inner_;
  mutable std::mutex mu_;
  std::map<std::string, std::size_t> calls_;
  std::map<std::string, Fault> faults_;
  std::size_t fired_ = 0;
  std::set<Stream> capturing_;
  std::map<Stream, std::uint64_t> recorded_;   // events recorded so far per stream
  std::map<Stream, std::uint64_t> completed_;  // events completed so far per stream
  std::map<Event, SimEvent> events_;
  Event next_event_ = 0;
  std::size_t host_waits_ = 0;
};

}  // namespace vmalloc::detail
