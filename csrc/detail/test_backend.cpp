#include "test_backend.h"

#include <stdexcept>

namespace vmalloc::detail {
namespace {

const std::set<std::string>& known_ops() {
  static const std::set<std::string> ops = {"reserve",      "release_reservation", "create_chunk", "release_chunk",
                                            "map",          "unmap",               "set_access",   "record_event",
                                            "event_done",   "event_synchronize",   "capturing",
                                            "synchronize"};
  return ops;
}

}  // namespace

TestBackend::TestBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

void TestBackend::fail(const std::string& op, std::size_t nth, bool once, bool out_of_memory) {
  if (!known_ops().count(op)) {
    std::string names;
    for (const auto& o : known_ops()) names += (names.empty() ? "" : ", ") + o;
    throw std::invalid_argument("unknown backend call '" + op + "': one of " + names);
  }
  if (nth == 0) throw std::invalid_argument("nth counts from 1 (the next call)");
  std::lock_guard<std::mutex> lock(mu_);
  faults_[op] = Fault{calls_[op] + nth, once, out_of_memory};
}

void TestBackend::clear_faults() {
  std::lock_guard<std::mutex> lock(mu_);
  faults_.clear();
}

std::map<std::string, std::size_t> TestBackend::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

std::size_t TestBackend::faults_fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

void TestBackend::maybe_fail(const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t n = ++calls_[op];
  auto f = faults_.find(op);
  if (f == faults_.end() || n < f->second.at) return;
  const Fault fault = f->second;
  if (fault.once) faults_.erase(f);
  ++fired_;
  const std::string msg = std::string("vmalloc ") + inner_->name() + " backend: " + op +
                          " failed: injected fault (call " + std::to_string(n) + ")";
  if (fault.out_of_memory && std::string(op) == "create_chunk") throw BackendOutOfMemory(op, msg);
  throw BackendError(op, msg);
}

std::uintptr_t TestBackend::reserve(std::size_t bytes) {
  maybe_fail("reserve");
  return inner_->reserve(bytes);
}
void TestBackend::release_reservation(std::uintptr_t base, std::size_t bytes) {
  maybe_fail("release_reservation");
  inner_->release_reservation(base, bytes);
}
ChunkHandle TestBackend::create_chunk(std::size_t bytes) {
  maybe_fail("create_chunk");
  return inner_->create_chunk(bytes);
}
void TestBackend::release_chunk(ChunkHandle chunk, std::size_t bytes) {
  maybe_fail("release_chunk");
  inner_->release_chunk(chunk, bytes);
}
void TestBackend::map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk, std::size_t offset) {
  maybe_fail("map");
  inner_->map(addr, bytes, chunk, offset);
}
void TestBackend::unmap(std::uintptr_t addr, std::size_t bytes) {
  maybe_fail("unmap");
  inner_->unmap(addr, bytes);
}
void TestBackend::set_access(std::uintptr_t addr, std::size_t bytes) {
  maybe_fail("set_access");
  inner_->set_access(addr, bytes);
}

Event TestBackend::record_event(Stream stream) {
  maybe_fail("record_event");
  std::lock_guard<std::mutex> lock(mu_);
  const Event e = ++next_event_;
  events_[e] = SimEvent{stream, ++recorded_[stream]};
  return e;
}
bool TestBackend::event_done(Event event) {
  maybe_fail("event_done");
  std::lock_guard<std::mutex> lock(mu_);
  const SimEvent& e = events_.at(event);
  return completed_[e.stream] >= e.position;
}
void TestBackend::event_synchronize(Event event) {
  maybe_fail("event_synchronize");
  std::lock_guard<std::mutex> lock(mu_);
  const SimEvent& e = events_.at(event);
  std::uint64_t& done = completed_[e.stream];
  if (done < e.position) {  // "waiting" runs the stream up to the event
    done = e.position;
    ++host_waits_;
  }
}
void TestBackend::synchronize() {
  maybe_fail("synchronize");
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [s, n] : recorded_) completed_[s] = n;
  ++host_waits_;
}
void TestBackend::release_event(Event event) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  events_.erase(event);
}
bool TestBackend::capturing(Stream stream) {
  maybe_fail("capturing");
  std::lock_guard<std::mutex> lock(mu_);
  return capturing_.count(stream) != 0;
}

void TestBackend::set_capturing(Stream stream, bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  if (on) capturing_.insert(stream);
  else capturing_.erase(stream);
}
void TestBackend::complete(Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  completed_[stream] = recorded_[stream];
}
void TestBackend::complete_all() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [s, n] : recorded_) completed_[s] = n;
}
std::map<Stream, std::size_t> TestBackend::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<Stream, std::size_t> out;
  for (const auto& [e, ev] : events_) {
    auto c = completed_.find(ev.stream);
    if (c == completed_.end() || c->second < ev.position) ++out[ev.stream];
  }
  return out;
}
std::size_t TestBackend::host_waits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_waits_;
}

}  // namespace vmalloc::detail
