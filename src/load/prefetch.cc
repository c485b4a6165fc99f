#include "pinload/prefetch.h"

#include <mutex>
#include <thread>
#include <unordered_set>

#include "base/log.h"
#include "io/read_session.h"
#include "load/load_counters.h"
#include "load/prefetch_handover.h"
#include "pinload/error.h"

namespace pinload {

struct Prefetch::State {
  explicit State(const Loader& l) : loader(l) {}
  Loader loader;  // a copy: shares the pools
  std::vector<std::string> paths;
  std::optional<IoTemplate> plan;
  Loader::Counters counters;
  std::stop_source stop;
  std::atomic<bool> finished{false};
  std::atomic<bool> adopted{false};
  std::mutex mu;  // guards joining `thread`, and `session` once it has joined
  std::jthread thread;
  // Written by `thread`; read by others only after it has joined.
  std::optional<Checkpoint> checkpoint;
  std::unique_ptr<detail::ReadSession> session;

  ~State() {
    stop.request_stop();
    if (thread.joinable()) thread.join();
  }

  // Requests the stop and joins the readers. Call with `mu` held.
  void stop_and_join() {
    stop.request_stop();
    if (thread.joinable()) thread.join();
  }
  void run() noexcept;
};

namespace {

// The checkpoint a template names, its identity checked again.
Checkpoint checkpoint_of_template(Env* env, const IoTemplate& plan) {
  Checkpoint checkpoint;
  std::unordered_set<std::string> names;
  for (const TemplateFile& tf : plan.files) {
    CheckpointFile f = read_checkpoint_file(env, tf.path);
    if (FileIdentity::of(f.stat) != tf.identity()) {
      throw IoError("file changed since its I/O template was recorded", ErrorContext{tf.path});
    }
    f.name_prefix = tf.name_prefix;
    for (const TensorInfo& t : f.header.tensors) {
      if (!names.insert(f.name_prefix + t.name).second) {
        throw InvalidFileError("tensor in two files of an I/O template", ErrorContext{tf.path, t.name});
      }
    }
    checkpoint.files.push_back(std::move(f));
  }
  return checkpoint;
}

// Whether `plan` was recorded for exactly these files.
bool template_matches(const IoTemplate& plan, const Checkpoint& checkpoint) {
  return plan.files == template_files_of(checkpoint).files;
}

}  // namespace

void Prefetch::State::run() noexcept {
  try {
    Env* env = loader.env();
    Checkpoint cp = paths.empty() ? checkpoint_of_template(env, *plan) : open_checkpoint(env, paths, loader.options().resolve);
    const TemplateReads* replay = nullptr;
    if (plan) {
      if (template_matches(*plan, cp)) {
        replay = plan->find(loader.destination());
        if (replay == nullptr) log::debug("the I/O template has no reads for {}", loader.destination());
      } else {
        log::warn("ignoring an I/O template recorded for other files than {}", paths.empty() ? "its own" : paths[0]);
      }
    }
    checkpoint = cp;
    if (stop.stop_requested()) {
      finished = true;
      return;
    }
    session = detail::ReadSession::open(env, loader.options().read_options(), std::move(cp), loader.staging_pool(),
                                        replay, &counters);
    detail::ReadSession& s = *session;
    s.allocate_blocks(*loader.pool(), stop.get_token());
    // Streaming: keep each staging block until the load hands it to a copy.
    detail::ChunkSink keep;
    if (s.streaming()) {
      keep = [&s](std::size_t i, std::shared_ptr<Block> block, std::size_t) { s.keep_staged(i, std::move(block)); };
    }
    s.execute(s.pending(), loader.options().threads, stop.get_token(), &counters, loader.numa_placement().cpus, keep);
  } catch (const CancelledError&) {
  } catch (const std::exception& e) {
    // The adopting load reads what is missing and reports its own error.
    log::debug("prefetch stopped early: {}", e.what());
  }
  finished = true;
}

Prefetch prefetch(const Loader& loader, std::vector<std::string> paths, const IoTemplate* plan) {
  auto state = std::make_shared<Prefetch::State>(loader);
  state->paths = std::move(paths);
  if (plan != nullptr) state->plan = *plan;
  try {
    state->thread = std::jthread([s = state.get()] { s->run(); });
  } catch (const std::system_error& e) {
    log::warn("cannot start a prefetch thread: {}", e.what());
    state->finished = true;
  }
  return Prefetch(std::move(state));
}

Prefetch prefetch(const Loader& loader, const IoTemplate& plan) {
  auto state = std::make_shared<Prefetch::State>(loader);
  state->plan = plan;
  try {
    state->thread = std::jthread([s = state.get()] { s->run(); });
  } catch (const std::system_error& e) {
    log::warn("cannot start a prefetch thread: {}", e.what());
    state->finished = true;
  }
  return Prefetch(std::move(state));
}

Prefetch::~Prefetch() = default;  // State's destructor stops and joins

void Prefetch::cancel() noexcept {
  if (!state_) return;
  state_->stop.request_stop();
  std::lock_guard lock(state_->mu);
  state_->stop_and_join();
  // A file's block that no chunk was read into is not needed.
  if (state_->session) state_->session->release_unread_blocks();
}

void Prefetch::wait() noexcept {
  if (!state_) return;
  std::lock_guard lock(state_->mu);
  if (state_->thread.joinable()) state_->thread.join();
}

bool Prefetch::done() const noexcept { return !state_ || state_->finished.load(); }

bool Prefetch::adopted() const noexcept { return state_ && state_->adopted.load(); }

LoadProgress Prefetch::progress() const noexcept { return state_ ? state_->counters.snapshot() : LoadProgress{}; }

const std::vector<std::string>& Prefetch::paths() const noexcept {
  static const std::vector<std::string> none;
  return state_ ? state_->paths : none;
}

namespace detail {

std::unique_ptr<ReadSession> PrefetchHandover::take(Prefetch& p) {
  Prefetch::State* state = p.state_.get();
  if (state == nullptr) return nullptr;
  state->stop.request_stop();
  std::lock_guard lock(state->mu);
  state->stop_and_join();
  state->adopted = true;
  return std::move(state->session);
}

bool PrefetchHandover::resolves_like(const Prefetch& p, const ResolveOptions& options) {
  return p.state_ && p.state_->loader.options().resolve.variant == options.variant;
}

bool PrefetchHandover::empty(const Prefetch& p) { return !p.state_ || p.paths().empty(); }

std::optional<Checkpoint> PrefetchHandover::checkpoint(Prefetch& p) {
  Prefetch::State* state = p.state_.get();
  if (state == nullptr) return std::nullopt;
  state->stop.request_stop();
  std::lock_guard lock(state->mu);
  state->stop_and_join();
  if (state->session) return state->session->checkpoint();
  return state->checkpoint;
}

}  // namespace detail

}  // namespace pinload
