// inproc.cc: the in-process transport: one mailbox per receiving stage.
#include "gpipe/transport.h"

#include "gpipe/check.h"

namespace gpipe {

InProcessTransport::InProcessTransport(int stages) {
  GPIPE_CHECK(stages >= 1, "a transport needs at least 1 stage (got ", stages, ")");
  for (int j = 0; j < stages; ++j) mailboxes_.push_back(std::make_unique<Mailbox>());
}

InProcessTransport::Mailbox& InProcessTransport::mailbox(int stage) {
  GPIPE_CHECK(stage >= 0 && stage < static_cast<int>(mailboxes_.size()), "stage ", stage,
              " is outside 0..", mailboxes_.size() - 1);
  return *mailboxes_[static_cast<size_t>(stage)];
}

void InProcessTransport::send(int from, int to, Channel channel, int micro_batch, Tensors tensors) {
  Mailbox& box = mailbox(to);
  {
    std::lock_guard<std::mutex> lock(box.mutex);
    if (box.cancelled) throw Cancelled(box.why);
    bytes_sent_ += tensors.bytes();
    box.messages[Key{from, static_cast<int>(channel), micro_batch}] = std::move(tensors);
  }
  box.arrived.notify_all();
}

Tensors InProcessTransport::recv(int from, int to, Channel channel, int micro_batch) {
  Mailbox& box = mailbox(to);
  const Key key{from, static_cast<int>(channel), micro_batch};
  std::unique_lock<std::mutex> lock(box.mutex);
  box.arrived.wait(lock, [&] { return box.cancelled || box.messages.count(key) > 0; });
  if (box.cancelled) throw Cancelled(box.why);
  auto it = box.messages.find(key);
  Tensors tensors = std::move(it->second);
  box.messages.erase(it);
  return tensors;
}

void InProcessTransport::cancel(const std::string& why) {
  cancelled_ = true;
  for (auto& box : mailboxes_) {
    {
      std::lock_guard<std::mutex> lock(box->mutex);
      if (!box->cancelled) box->why = why;
      box->cancelled = true;
    }
    box->arrived.notify_all();
  }
}

void InProcessTransport::begin(const std::vector<const std::vector<Action>*>& /*programs*/) {
  if (cancelled_)  // the runtime's mistake, not the caller's
    throw std::logic_error("gpipe: the in-process transport was cancelled; a failed step is followed by a transport "
                           "of its own");
  for (auto& box : mailboxes_) {
    std::lock_guard<std::mutex> lock(box->mutex);
    box->messages.clear();  // a step that ended with finish() left none; a caller's stray sends go
  }
}

}  // namespace gpipe
