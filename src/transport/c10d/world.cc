// world.cc (c10d): the job torchrun started: its variables, its store, the gathers of the set-up, the
// thread that watches the error flags, and the job's end.
#include "transport/c10d/c10d.h"

#include "gpipe/c10d_backend.h"
#include "gpipe/check.h"
#include "gpipe/environment.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <thread>

#include <sched.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#include <unistd.h>

namespace gpipe::c10d {

namespace {

int whole_variable(const char* name, int low, int high) {
  const std::string text = environment_value(name);
  size_t used = 0;
  long value = -1;
  try {
    value = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  GPIPE_CHECK(used == text.size() && !text.empty() && value >= low && value <= high, "the environment variable ", name,
              " is \"", text, "\"; an env:// launcher (torchrun) sets it to a whole number from ", low, " to ", high);
  return static_cast<int>(value);
}


// The started job; never destroyed (a World that start_over replaces is kept, its stores let go).
World* the_world = nullptr;
std::mutex world_mutex;  // the_world

// The error flags' watcher: every live Links' flag, and the job's end, looked at every 100 ms.
struct Watcher {
  std::mutex mutex;
  std::condition_variable woken;
  std::set<Links*> links;
  c10::intrusive_ptr<::c10d::Store> store;
  bool stopped = false;  // its job replaced (start_over): it watches no more
};
Watcher* the_watcher = nullptr;

constexpr char kAbortKey[] = "abort";

void watch_forever(Watcher* w) {
  try {
    for (;;) {
      std::vector<std::pair<Links*, std::string>> keys;
      {
        const std::lock_guard<std::mutex> lock(w->mutex);
        for (Links* l : w->links) keys.emplace_back(l, l->flag_key());
      }
      for (const auto& [links, key] : keys) {
        if (!w->store->check({key})) continue;
        const std::string value = text_of(w->store->get(key));
        const std::lock_guard<std::mutex> lock(w->mutex);
        if (w->links.count(links) > 0) links->flagged(value);  // still watched
      }
      if (w->store->check({kAbortKey})) {
        // Another process ends the job (abort): this one ends with it, at once, saying which did.
        const std::string value = text_of(w->store->get(kAbortKey));  // "STATUS RANK"
        const size_t space = value.find(' ');
        if (space != std::string::npos)
          print_error_line("gpipe: rank " + value.substr(space + 1) + " ended the job (exit status " +
                           value.substr(0, space) + "); its output says why");
        _exit(std::atoi(value.c_str()));
      }
      std::unique_lock<std::mutex> lock(w->mutex);
      if (w->woken.wait_for(lock, std::chrono::milliseconds(100), [w] { return w->stopped; })) return;
    }
  } catch (const std::exception&) {
    // The store is gone (the launcher ended): nothing more can be heard.
  }
  const std::lock_guard<std::mutex> lock(w->mutex);
  w->store.reset();  // its connection closed (the Watcher itself stays: others may still point to it)
}

}  // namespace

bool launched() {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    if (environment_value(name).empty()) return false;
  return environment_value("WORLD_SIZE") != "1";  // a job of one process runs as one process
}

bool started() {
  const std::lock_guard<std::mutex> lock(world_mutex);
  return the_world != nullptr;
}

World& world() {
  const std::lock_guard<std::mutex> lock(world_mutex);
  GPIPE_CHECK(the_world != nullptr, "the c10d runtime needs a job that torchrun started (or the variables of "
              "torch.distributed's env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); start the program with "
              "torchrun, one process per device, or choose another runtime");
  return *the_world;
}

namespace {

// A client connection of its own to the TCPStore server at host:port.
c10::intrusive_ptr<::c10d::Store> tcp_client(const std::string& host, int port, std::chrono::milliseconds timeout) {
  ::c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  return c10::make_intrusive<::c10d::TCPStore>(host, options);
}

}  // namespace

std::string rank_name(const std::vector<int>& known_as, int r) {
  std::string name = "rank " + std::to_string(r);
  if (r >= 0 && static_cast<size_t>(r) < known_as.size() && known_as[static_cast<size_t>(r)] != r)
    name += " (" + std::to_string(known_as[static_cast<size_t>(r)]) + " in the default group)";
  return name;
}

std::string most_wait(const World& w) {
  return "it waits " + std::to_string(w.timeout.count() / 1000) + " s at most (GPIPE_TIMEOUT)";
}

c10::intrusive_ptr<::c10d::Store> connect_store(const std::string& prefix, std::chrono::milliseconds timeout) {
  const World& w = world();
  auto store = w.shared ? w.shared : tcp_client(w.host, w.port, timeout.count() > 0 ? timeout : w.timeout);
  return c10::make_intrusive<::c10d::PrefixStore>(prefix.empty() ? w.prefix : w.prefix + "/" + prefix, store);
}

WaitNotice::WaitNotice(std::function<std::string(int)> line) {
  thread_ = std::thread([this, line = std::move(line)] {
    const auto begin = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    for (auto next = std::chrono::seconds(10);; next += std::chrono::seconds(60)) {
      if (ended_.wait_until(lock, begin + next, [this] { return done_; })) return;
      lock.unlock();
      try {
        print_error_line("gpipe: " + line(static_cast<int>(next.count())));
      } catch (...) {  // a notice that cannot be worded is not said
      }
      lock.lock();
    }
  });
}

WaitNotice::~WaitNotice() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  ended_.notify_all();
  thread_.join();
}

namespace {

std::mutex start_mutex;  // one start, whichever threads ask

// GPIPE_TIMEOUT, or its default, and the job's keys (per torchrun restart) of a World being made.
void set_timeout_and_prefix(World& w) {
  const std::string timeout = environment_value("GPIPE_TIMEOUT");
  double seconds = 1800;
  if (!timeout.empty()) {
    size_t used = 0;
    try {
      seconds = std::stod(timeout, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    GPIPE_CHECK(used == timeout.size() && seconds >= 1 && seconds <= 1e6, "GPIPE_TIMEOUT is \"", timeout,
                "\"; give the seconds any wait of the job may last, from 1 to 1000000 (default 1800)");
  }
  w.timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  const std::string restart = environment_value("TORCHELASTIC_RESTART_COUNT");
  w.prefix = "gpipe/" + (restart.empty() ? std::string("0") : restart);
}

}  // namespace

void bind_to_cores() {
  if (environment_choice("GPIPE_BIND_CORES", {"0", "1"},
                         "1 binds each torchrun rank of a machine to its share of the cores, as mpirun does; "
                         "0, the default, leaves them to the kernel") != "1")
    return;
  const std::string local_rank = environment_value("LOCAL_RANK"), local_size = environment_value("LOCAL_WORLD_SIZE");
  if (local_rank.empty() || local_size.empty()) return;
  int rank = 0, size = 0;
  try {
    rank = std::stoi(local_rank);
    size = std::stoi(local_size);
  } catch (const std::exception&) {
    return;  // not torchrun's: nothing to go by
  }
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (size < 2 || rank < 0 || rank >= size || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  const size_t n = cores.size(), first = n * static_cast<size_t>(rank) / static_cast<size_t>(size),
               last = n * static_cast<size_t>(rank + 1) / static_cast<size_t>(size);
  // Fewer cores than processes: the kernel shares them. Fewer than the machine's: already bound (by
  // taskset, numactl, Slurm), which is kept.
  if (n < static_cast<size_t>(size) || static_cast<long>(n) < sysconf(_SC_NPROCESSORS_ONLN)) return;
  cpu_set_t mine;
  CPU_ZERO(&mine);
  for (size_t c = first; c < last; ++c) CPU_SET(cores[c], &mine);
  sched_setaffinity(0, sizeof(mine), &mine);
}

namespace {

// The World made, with its store: Gloo's device, then the job started for the rest of the process
// (start_mutex held).
World& begin(std::unique_ptr<World> w) {
  const std::string interface = environment_value("GLOO_SOCKET_IFNAME");
  w->device = interface.empty() ? ::c10d::ProcessGroupGloo::createDefaultDevice()
                                : ::c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  {
    const std::lock_guard<std::mutex> lock(world_mutex);
    the_world = w.release();
  }
  try {
    auto* watcher = new Watcher;  // never destroyed, as its thread is never joined
    watcher->store = connect_store("");
    the_watcher = watcher;
    std::thread(watch_forever, watcher).detach();
  } catch (...) {
    const std::lock_guard<std::mutex> lock(world_mutex);
    delete the_world;  // not started: a later start tries again
    the_world = nullptr;
    throw;
  }
  return *the_world;
}

// The World start_over replaces, or let go of: its watcher stops and its stores are let go (a
// process group's server with them); no World is then started. The World itself stays, for any
// reference still held (world_mutex held).
void retire_the_world() {
  World* old = the_world;
  the_world = nullptr;
  if (the_watcher != nullptr) {
    {
      const std::lock_guard<std::mutex> lock(the_watcher->mutex);
      the_watcher->stopped = true;
    }
    the_watcher->woken.notify_all();
    the_watcher = nullptr;  // its thread ends; the Watcher is never destroyed
  }
  old->store.reset();
  old->given.reset();
  old->shared.reset();
  old->device.reset();
}

// Why this process cannot take a new group: `own`, the message it raises, and `theirs`, what its
// peers hear; both "" where it can.
struct Refusal {
  std::string own, theirs;
};

// The refusal to replace `old` (world_mutex held): a job torchrun started is the process's for good,
// and another group's World is replaced once no pipeline of this process runs over it.
Refusal refusal_to_replace(const World& old) {
  if (!old.given)
    return {"the c10d backend of this process runs over the job torchrun started (MASTER_ADDR, RANK...; " +
                rank_name(old.known_as, old.rank) + " of " + std::to_string(old.size) +
                "), and every pipeline of a process runs over it: give no process_group",
            "its process runs over the job torchrun started, for good; give no process_group under torchrun"};
  const size_t alive = live_pipelines();
  if (alive == 0) return {};
  const std::string pipelines = std::to_string(alive) + (alive == 1 ? " pipeline" : " pipelines");
  const std::string use = alive == 1 ? " uses" : " use";
  const std::string fix = "end those pipelines first (Python: del the GPipe objects)";
  return {"the c10d backend of this process runs over another process group (" + rank_name(old.known_as, old.rank) +
              " of " + std::to_string(old.size) + "), which " + pipelines + " of this process still" + use +
              "; every pipeline of a process runs over the same group: pass the same process_group, or " + fix,
          pipelines + " of its process still" + use + " the group before; " + fix +
              ", then make the GPipe over the new group on every rank"};
}

// The vote of a start over a new group: every rank says under the start's own keys (`said`, a
// connection of this thread's) whether it takes the group or why not; one that does not throws
// `refused.own` at once, and the others, once they have heard, throw naming it: no rank waits for
// one that will not come. A rank that stops waiting (GPIPE_TIMEOUT, or `between` throwing) says it
// gave up, so that one that comes later does not take the group alone (start_mutex held, not
// world_mutex).
// The wait's slices go through `waits()`, a connection made for them and dropped with the vote, not
// through `said`: a TCPStore wait that times out leaves on its connection the server's answer, sent
// once the key is set, and its 100 ms timeout. On `said`, the check or get after it read that stale
// answer as their own (the get then waited GPIPE_TIMEOUT for bytes that never came, while the other
// rank, past the vote, waited for this one to connect) or timed out under load. On `waits()` a stale
// answer only ends a later slice early, and `said` checks after every slice.
void vote_on_new_group(const World& w, const c10::intrusive_ptr<::c10d::Store>& said,
                       const std::function<c10::intrusive_ptr<::c10d::Store>()>& waits, const Refusal& refused,
                       const std::function<void()>& between) {
  const std::string mine = std::to_string(w.rank);
  said->set(mine, bytes_of(refused.own.empty() ? "+" : "-" + refused.theirs));
  GPIPE_CHECK(refused.own.empty(), refused.own);
  const auto deadline = std::chrono::steady_clock::now() + w.timeout;
  c10::intrusive_ptr<::c10d::Store> waiting;  // the slices' connection, made at the first slice
  for (int r = 0; r < w.size; ++r) {
    if (r == w.rank) continue;
    const std::string key = std::to_string(r);
    // Said before this rank stops waiting, whatever stops it.
    const auto give_up = [&] {
      try {
        said->set(mine, bytes_of("-" + rank_name(w.known_as, w.rank) + " gave up waiting for " +
                                 rank_name(w.known_as, r) + "; make the GPipe over the new group again on every rank"));
      } catch (const std::exception&) {
        // The store is gone: the others hear nothing more from it either.
      }
    };
    bool answered = false;
    try {
      const WaitNotice notice([&w, r](int seconds) {
        return rank_name(w.known_as, w.rank) + " has waited " + std::to_string(seconds) + " s for " +
               rank_name(w.known_as, r) + " to take the new process group; " + most_wait(w) +
               ": check that every rank makes its GPipe over the group";
      });
      // In slices, between which `between` may stop the wait; a store that stops answering throws.
      while (!(answered = said->check({key}))) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                                std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        if (!waiting) waiting = waits();
        try {
          waiting->wait({key}, std::min(left, std::chrono::milliseconds(100)));
        } catch (const std::exception&) {
          if (between) between();  // the slice ran out (or the store broke: check says so)
        }
      }
    } catch (const c10::Error& e) {
      give_up();
      GPIPE_CHECK(false, rank_name(w.known_as, w.rank), " could not start over the new process group: the store "
                  "stopped answering while it waited for ", rank_name(w.known_as, r), " (",
                  first_line(e.what_without_backtrace()), "); check that the process hosting it still runs");
    } catch (...) {  // `between` stopped it
      give_up();
      throw;
    }
    if (!answered) {
      give_up();
      GPIPE_CHECK(false, rank_name(w.known_as, w.rank), " could not start over the new process group: ",
                  rank_name(w.known_as, r), " did not say whether it takes it within ", w.timeout.count() / 1000,
                  " s (GPIPE_TIMEOUT); check that every rank of the group makes its GPipe over it");
    }
    const std::string answer = text_of(said->get(key));
    GPIPE_CHECK(answer == "+", rank_name(w.known_as, r), " could not take the new process group, so neither does ",
                rank_name(w.known_as, w.rank), ": ", answer.substr(1));
  }
}

}  // namespace

void start_over(c10::intrusive_ptr<::c10d::Store> store, int rank, int size, const std::string& scope,
                const std::vector<int>& known_as, bool let_go, const std::function<void()>& between) {
  GPIPE_CHECK(store, "the c10d backend needs a store (a torch.distributed process group's)");
  GPIPE_CHECK(size >= 1 && rank >= 0 && rank < size, "rank ", rank, " of ", size,
              " processes: a rank runs from 0 to the processes less 1");
  GPIPE_CHECK(known_as.empty() || known_as.size() == static_cast<size_t>(size), "`known_as` names ", known_as.size(),
              " ranks of a group of ", size, "; give one number per rank, or none");
  const std::lock_guard<std::mutex> starting(start_mutex);
  {
    const std::lock_guard<std::mutex> lock(world_mutex);
    if (the_world != nullptr && the_world->given == store && the_world->scope == scope &&
        the_world->rank == rank && the_world->size == size)
      return;
  }
  auto w = std::make_unique<World>();
  w->rank = rank;
  w->size = size;
  w->known_as = known_as;
  w->given = store;
  w->scope = scope;
  w->let_go = let_go;
  set_timeout_and_prefix(*w);
  if (!scope.empty()) w->prefix += "/" + scope;
  // A TCPStore under the group's prefixes: connections of gpipe's own to its server (a wait on one
  // then holds up no other thread's calls, the caller's torch.distributed among them); any other
  // store is shared.
  c10::intrusive_ptr<::c10d::Store> base = store;
  while (auto* prefixed = dynamic_cast<::c10d::PrefixStore*>(base.get())) base = prefixed->getUnderlyingStore();
  c10::intrusive_ptr<::c10d::Store> own = store;
  if (auto* tcp = dynamic_cast<::c10d::TCPStore*>(base.get())) {
    w->host = tcp->getHost();
    w->port = tcp->getPort();
    own = tcp_client(w->host, w->port, w->timeout);
  }
  // The n-th start over this store by this rank, as by every other: keys of its own, so that a store
  // started over before (its pipelines let go of, then another made) holds nothing of the last time.
  w->prefix += "/" + std::to_string(
                         c10::make_intrusive<::c10d::PrefixStore>(w->prefix + "/started", store)->add(std::to_string(rank), 1));
  // Whether this process can take the group, decided and acted on at once: where it can, the World
  // before (if any) is let go of before the vote, so that no pipeline is made over it meanwhile.
  Refusal refused;
  {
    const std::lock_guard<std::mutex> lock(world_mutex);
    if (the_world != nullptr) {
      refused = refusal_to_replace(*the_world);
      if (refused.own.empty()) retire_the_world();
    }
  }
  const std::string taken = w->prefix + "/taken";
  const auto waits = [&]() -> c10::intrusive_ptr<::c10d::Store> {  // the vote's slices' connection
    return c10::make_intrusive<::c10d::PrefixStore>(
        taken, w->host.empty() ? store : tcp_client(w->host, w->port, w->timeout));
  };
  vote_on_new_group(*w, c10::make_intrusive<::c10d::PrefixStore>(taken, own), waits, refused, between);
  if (w->host.empty()) w->shared = store;
  w->store = c10::make_intrusive<::c10d::PrefixStore>(w->prefix, own);  // the vote's connection, kept
  begin(std::move(w));
}

namespace {

// torchrun's agent is this rank's parent: it hosts the store and ends the ranks when one fails. An
// agent killed outright (SIGKILL) would leave its ranks training, orphaned; the kernel sends them
// SIGTERM as it dies instead, which stops them as the agent's own SIGTERM does (at a step boundary,
// the file saved).
// The parent as this process started (the library loads with it): torchrun's agent, for a rank.
const pid_t parent_at_start = getppid();

// An agent that died before this rank came here left it without a store: refused at once, rather
// than waiting GPIPE_TIMEOUT for the store.
void stop_when_the_agent_dies() {
  // A rank's parent is its agent; init (1) has it only once the agent is gone, maybe before the
  // process started (a wrapper script's sleep).
  GPIPE_CHECK(getppid() == parent_at_start && getppid() != 1, "torchrun's agent (this rank's parent) ended before this "
              "rank connected to its store: the job is gone; start it again");
#if defined(__linux__)
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent_at_start) raise(SIGTERM);  // it died between the check and the call
#endif
}

}  // namespace

World& start() {
  const std::lock_guard<std::mutex> starting(start_mutex);
  {
    const std::lock_guard<std::mutex> lock(world_mutex);
    if (the_world != nullptr) return *the_world;
  }
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    GPIPE_CHECK(!environment_value(name).empty(), "the environment variable ", name, " is not set; start the job with torchrun "
                "(one process per device), which sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE");
  auto w = std::make_unique<World>();
  w->size = whole_variable("WORLD_SIZE", 1, 1 << 20);
  w->rank = whole_variable("RANK", 0, w->size - 1);
  w->host = environment_value("MASTER_ADDR");
  w->port = whole_variable("MASTER_PORT", 1, 65535);
  set_timeout_and_prefix(*w);
  w->agent_store = environment_value("TORCHELASTIC_USE_AGENT_STORE") == "True";
  if (w->agent_store) stop_when_the_agent_dies();
  ::c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(w->port);
  options.isServer = !w->agent_store && w->rank == 0;  // else torchrun's agent, or rank 0, hosts it
  options.waitWorkers = false;  // the ranks meet in Gloo's rendezvous, each waiting for the others there
  options.timeout = w->timeout;
  options.multiTenant = true;
  try {
    const WaitNotice notice([&w](int seconds) {
      return "rank " + std::to_string(w->rank) + " has waited " + std::to_string(seconds) + " s for the job's store at " +
             w->host + ":" + std::to_string(w->port) + " (torchrun's agent or rank 0 hosts it); " + most_wait(*w) +
             ": check that rank 0 was started";
    });
    w->store = c10::make_intrusive<::c10d::PrefixStore>(
        w->prefix, c10::make_intrusive<::c10d::TCPStore>(w->host, options));
  } catch (const std::exception& e) {
    GPIPE_CHECK(false, "rank ", w->rank, " could not reach the job's store at ", w->host, ":", w->port, " (",
                e.what(), "); check MASTER_ADDR and MASTER_PORT, and that every rank of the job was started");
  }
  return begin(std::move(w));
}

void pipeline_ended() {
  const std::lock_guard<std::mutex> starting(start_mutex);
  const std::lock_guard<std::mutex> lock(world_mutex);
  if (the_world == nullptr || !the_world->let_go || live_pipelines() > 0) return;
  retire_the_world();
}

void watch(Links* links) {
  const std::lock_guard<std::mutex> lock(the_watcher->mutex);
  the_watcher->links.insert(links);
}

void unwatch(Links* links) {
  const std::lock_guard<std::mutex> lock(the_watcher->mutex);
  the_watcher->links.erase(links);
}

void abort(int status) {
  if (started()) {
    try {
      connect_store("", std::chrono::seconds(5))
          ->set(kAbortKey, bytes_of(std::to_string(status) + " " + std::to_string(world().rank)));
    } catch (const std::exception&) {
      // The store is gone: the launcher ends the others.
    }
  }
  _exit(status);
}

void end_job(int status, const std::string& message, const std::function<void(const std::string&)>& print) {
  // As under MPI (mpi::end_job): ranks that fail together print each different message once; a rank
  // that does not come within 5 s only delays the end. torchrun ends the others once one exits.
  for (int s : {SIGINT, SIGTERM, SIGHUP}) std::signal(s, SIG_DFL);
  const World& w = world();
  std::vector<std::string> all;
  try {
    auto store = connect_store("end", std::chrono::seconds(5));
    store->set(std::to_string(w.rank), bytes_of(message));
    std::vector<std::string> keys;
    for (int r = 0; r < w.size; ++r) keys.push_back(std::to_string(r));
    store->wait(keys, std::chrono::seconds(5));
    for (const std::string& key : keys) all.push_back(text_of(store->get(key)));
    if (w.rank == 0) {
      detail::print_by_message(all, print);
      store->set("printed", bytes_of("1"));
    } else {
      store->wait({"printed"}, std::chrono::seconds(5));
    }
  } catch (const std::exception&) {
    if (all.empty()) print("[rank " + std::to_string(w.rank) + "] " + message);
  }
  abort(status);
}

}  // namespace gpipe::c10d
