#include "streams.h"

#include <chrono>

namespace fakecuda {

std::string Work::describe() const {
  const std::string delay = delay_us ? " after " + std::to_string(delay_us) + " us" : "";
  switch (kind) {
    case Kind::kMarker: return "event record";
    case Kind::kWait: return "wait for an event";
    case Kind::kFill: return "fill with " + hex(byte) + " of " + range_text(dst, n) + delay;
    case Kind::kCopy: return "copy " + range_text(src, n) + " to " + hex(dst) + delay;
    case Kind::kRead: return "read " + range_text(src, n) + " to the host" + delay;
    case Kind::kExpect: return "expect " + hex(byte) + " in " + range_text(src, n) + delay;
    case Kind::kSleep: return "sleep" + delay;
  }
  return "?";
}

Stream::Stream(int id_, int device_, Kind kind_, std::mutex& mu, std::condition_variable& progress, Executor execute)
    : id(id_), device(device_), kind(kind_), mu_(mu), progress_(progress), execute_(std::move(execute)),
      worker_([this] { run(); }) {}

Stream::~Stream() { join(); }

std::uint64_t Stream::push(Work w) {
  w.seq = ++enqueued;
  clock.advance(static_cast<std::size_t>(id), w.seq);
  queue_.push_back(std::move(w));
  progress_.notify_all();
  return enqueued;
}

void Stream::request_stop() {
  stop_ = true;
  progress_.notify_all();
}

void Stream::join() {
  if (worker_.joinable()) worker_.join();
}

bool Stream::deps_done(const Work& w) const {
  for (const Dep& d : w.deps)
    if (d.stream->completed < d.seq) return false;
  return true;
}

void Stream::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    progress_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) break;  // stopped and drained
    // A reference into a deque stays valid while other items are pushed at the back.
    const Work& w = queue_.front();
    progress_.wait(lock, [&] { return deps_done(w); });
    if (w.delay_us) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(w.delay_us));
      lock.lock();
    }
    execute_(*this, w);
    completed = w.seq;
    queue_.pop_front();
    progress_.notify_all();
  }
  exited_ = true;
}

}  // namespace fakecuda
