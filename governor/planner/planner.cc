#include "governor/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "base/units.h"

namespace bgl::plan {

namespace {
// The nearest plan (Plan::nearest): the budget buckets on each side of a cold key whose cached
// plans it may be served, and how many distinct plans are costed at its load.
constexpr int64_t kNearestBudgets = 2;
constexpr size_t kNearestPlans = 8;

// A background thread's priority option (warm_nice, refine_nice): a nice value in [0, 19].
Status CheckNice(const char* name, int value) {
  if (value >= 0 && value <= 19) return OkStatus();
  return InvalidArgument(std::string(name) + ": must be in [0, 19], got " + std::to_string(value));
}

}  // namespace

Result<std::unique_ptr<StagePlanner>> StagePlanner::Create(const ModelConfig& config,
                                                           const HardwareProfile& hw,
                                                           const PlannerOptions& options) {
  BGL_RETURN_IF_ERROR(config.Validate());
  BGL_RETURN_IF_ERROR(hw.Validate());
  if (options.capacity_bytes < 0) {
    return InvalidArgument("capacity: must be non-negative, got " +
                           std::to_string(options.capacity_bytes));
  }
  if (options.budget_step_bytes <= 0) return InvalidArgument("budget_step_bytes must be positive");
  if (!(options.load_bucket > 0)) return InvalidArgument("load_bucket must be positive");
  if (!(options.offload_chunk_bytes > 0)) {
    return InvalidArgument("offload_chunk_bytes must be positive");
  }
  if (options.cache_entries == 0) return InvalidArgument("cache_entries must be positive");
  if (!std::isfinite(options.warm_spike_bound) || options.warm_spike_bound < 1 ||
      options.warm_spike_bound > 64) {
    return InvalidArgument(
        "warm_spike_bound: the highest load factor the warm-up plans for must be in [1, 64], "
        "got " +
        std::to_string(options.warm_spike_bound));
  }
  if (options.warm_max_keys > options.cache_entries / 2) {
    return InvalidArgument("warm_max_keys: at most half the plan cache (" +
                           std::to_string(options.cache_entries / 2) +
                           " of cache_entries), so the warm-up never evicts its own plans; got " +
                           std::to_string(options.warm_max_keys));
  }
  if (options.warm_rounds < 1) return InvalidArgument("warm_rounds must be at least 1");
  BGL_RETURN_IF_ERROR(CheckNice("warm_nice", options.warm_nice));
  BGL_RETURN_IF_ERROR(CheckNice("refine_nice", options.refine_nice));
  if (!std::isfinite(options.gate_search_share) || options.gate_search_share < 0 ||
      options.gate_search_share > 1) {
    return InvalidArgument(
        "gate_search_share: the share of the exposed overhead the downgrade's search may cost "
        "must be in [0, 1], got " +
        std::to_string(options.gate_search_share));
  }
  auto graph = BuildStageGraph(config, hw);
  if (!graph.ok()) return graph.status();
  auto steps =
      BuildSchedule(static_cast<int>(config.pp), options.pipeline_rank,
                    static_cast<int>(config.MicroBatches()), static_cast<int>(config.Chunks()));
  if (!steps.ok()) return steps.status();
  const double capacity =
      static_cast<double>(options.capacity_bytes > 0 ? options.capacity_bytes : hw.memory_bytes);
  const double fixed = config.StaticBytesPerGpu() + static_cast<double>(config.workspace_bytes) +
                       config.safety_margin * capacity;
  const double m_max = capacity - fixed;
  const double m0 = graph->M0(1.0);
  const int warmup =
      WarmupForwards(static_cast<int>(config.pp), options.pipeline_rank,
                     static_cast<int>(config.MicroBatches()), static_cast<int>(config.Chunks()));
  if (m_max < (warmup + 1) * m0) {
    return InvalidArgument("capacity: " + FormatBytes(capacity) + " leaves " +
                           FormatBytes(std::max(0.0, m_max)) +
                           " for activations after weights, gradients and optimizer state (" +
                           FormatBytes(config.StaticBytesPerGpu()) + "), workspace and margin; " +
                           std::to_string(warmup + 1) + " micro-batches in flight need at least " +
                           FormatBytes((warmup + 1) * m0) + " (M0 each)");
  }
  return std::unique_ptr<StagePlanner>(
      new StagePlanner(config, hw, options, std::move(*graph), std::move(*steps), m_max));
}

StagePlanner::StagePlanner(ModelConfig config, HardwareProfile hw, PlannerOptions options,
                           StageGraph graph, std::vector<Step> steps, double m_max)
    : config_(std::move(config)),
      hw_(std::move(hw)),
      options_(options),
      graph_(std::move(graph)),
      steps_(std::move(steps)),
      m_max_(m_max),
      tracker_(m_max, graph_.M0(1.0)),
      mitigation_cache_(options.cache_entries),
      schedule_cache_(options.cache_entries) {
  eval_ = std::make_unique<CostEvaluator>(graph_, hw_);
  const size_t units = static_cast<size_t>(config_.MicroBatches() * config_.Chunks());
  units_.resize(units);
  forward_step_.assign(units, -1);
  previous_forward_.assign(units, -1);
  next_backward_.assign(units, -1);
  int last_forward = -1, last_backward = -1;
  for (size_t i = 0; i < steps_.size(); ++i) {
    const int unit = UnitIndex(steps_[i].micro_batch, steps_[i].chunk);
    if (steps_[i].forward) {
      forward_step_[unit] = static_cast<int>(i);
      previous_forward_[unit] = last_forward;
      last_forward = unit;
    } else {
      if (last_backward >= 0) next_backward_[last_backward] = unit;
      last_backward = unit;
    }
  }
  keep_all_ = Intern(Assignment(graph_.ops.size(), Strategy::kKeep), 1.0, false);
  anytime_ = options_.anytime_min_ops > 0 &&
             graph_.ops.size() >= static_cast<size_t>(options_.anytime_min_ops);
  if (anytime_ && options_.refine_first_answers) {
    refiner_ = std::make_unique<Refiner>(graph_, options_.refine_timeout_ms, options_.refine_nice);
  }
  if (options_.warm_up) {
    warm_refiner_ =
        std::make_unique<Refiner>(graph_, options_.refine_timeout_ms, options_.warm_nice);
  }
  mitigation_cache_.set_on_evict([this](const MitigationKey&, const CachedAssignment& entry) {
    if (entry.warm) --warm_live_;
  });
}

StagePlanner::~StagePlanner() {
  refiner_.reset();  // joined: no job lands after this
  warm_refiner_.reset();
  ShareWarmPlans(nullptr);  // the keys this planner claimed and never landed go back
}

void StagePlanner::ShareWarmPlans(std::shared_ptr<SharedPlans> shared) {
  if (shared_) {
    for (const auto& [key, landed] : warm_submitted_) {
      if (!landed) shared_->Release(key);
    }
  }
  shared_ = std::move(shared);
}

bool StagePlanner::ClaimWarm(const MitigationKey& key) {
  if (warm_submitted_.count(key) > 0) return false;
  if (shared_ && !shared_->Claim(key)) {
    warm_submitted_.emplace(key, true);  // another planner's: never searched here
    return false;
  }
  warm_submitted_.emplace(key, false);
  return true;
}

const StagePlanner::CachedAssignment* StagePlanner::FromShared(const MitigationKey& key) {
  if (!shared_) return nullptr;
  std::optional<SharedPlans::Entry> entry = shared_->Find(key);
  if (!entry) return nullptr;
  CachedAssignment cached;
  cached.id = Intern(std::move(entry->assignment), entry->planned_r, entry->fallback);
  cached.warm = true;
  cached.shared = true;
  ++warm_live_;
  return &mitigation_cache_.Insert(key, cached);
}

PlannerCacheStats StagePlanner::cache_stats() const {
  PlannerCacheStats stats{mitigation_cache_.counters(), schedule_cache_.counters()};
  stats.first_answers = first_answers_;
  stats.refined = refined_;
  stats.improved = improved_;
  stats.refine_expired = refine_expired_;
  stats.warm_keys = warm_live_;
  stats.warm_enumerated = warm_found_.size();
  stats.warm_submitted = warm_submitted_.size();
  stats.warm_done = warm_done_;
  stats.warm_hits = warm_hits_;
  stats.warm_nearest = warm_nearest_;
  stats.warm_rounds = warm_rounds_;
  stats.warm_complete = warm_complete_;
  stats.warm_cpu_s = warm_cpu_s_;
  stats.refine_cpu_s = refine_cpu_s_;
  stats.warm_shared_hits = warm_shared_hits_;
  stats.warm_shared_keys = shared_ ? shared_->size() : 0;
  stats.gate_searches = gate_searches_;
  stats.gate_searches_cut = gate_searches_cut_;
  stats.gate_search_s = gate_search_s_;
  return stats;
}

void StagePlanner::ApplyRefinements() {
  for (Refiner* refiner : {refiner_.get(), warm_refiner_.get()}) {
    if (refiner != nullptr && refiner->HasDone()) ApplyDone(refiner->TakeDone());
  }
  // A round's jobs all landed: the next round enumerates with their bytes, or with the budget
  // buckets the run's points have met since.
  if (warm_started_ && warm_observed_new_) WarmObserved();
  if (warm_started_ && !warm_complete_ && warm_in_flight_ == 0) {
    if (warm_last_round_) {
      warm_complete_ = true;
    } else {
      WarmRound();
    }
  }
}

void StagePlanner::WarmObserved() {
  warm_observed_new_ = false;
  const double lb = options_.load_bucket;
  const double step = static_cast<double>(options_.budget_step_bytes);
  const auto first = static_cast<int64_t>(std::ceil(1.0 / lb - 1e-9));
  const auto last = static_cast<int64_t>(std::ceil(options_.warm_spike_bound / lb - 1e-9));
  const Interned& keep_all = interned_[keep_all_];
  const size_t cap = WarmCap();
  // Load buckets ascending, each met budget in turn: the loads nearest the common ones first.
  for (int64_t bucket = first; bucket <= last; ++bucket) {
    const double r = static_cast<double>(bucket) * lb;
    for (const MitigationKey& met : warm_observed_) {
      if (warm_submitted_.size() >= cap) return;
      if (static_cast<double>(met.budget_bucket) * step >=
          keep_all.device_fixed + keep_all.device_per_load * r) {
        continue;  // keep-all at this load
      }
      MitigationKey key = met;
      key.load_bucket = bucket;
      warm_found_.insert(key);
      const CachedAssignment* cached = mitigation_cache_.Peek(key);
      if (cached != nullptr && !cached->first_answer) continue;  // a miss's full search stands
      if (!ClaimWarm(key)) continue;
      RefineJob job = JobFor(key);
      job.warm = true;
      warm_refiner_->Submit(std::move(job), /*ahead=*/true);
      ++warm_in_flight_;
      warm_complete_ = false;
    }
  }
}

size_t StagePlanner::WarmCap() const {
  return options_.warm_max_keys > 0 ? options_.warm_max_keys : mitigation_cache_.capacity() / 2;
}

void StagePlanner::ApplyDone(std::vector<RefineDone> finished) {
  for (RefineDone& done : finished) {
    if (done.generation != generation_) continue;  // the caches were cleared since
    if (done.warm) {
      LandWarm(done);
      continue;
    }
    refine_cpu_s_ += done.cpu_s;
    CachedAssignment* entry = mitigation_cache_.Peek(done.key);
    if (entry == nullptr || !entry->first_answer) continue;  // evicted: a miss plans it again
    if (done.expired) {
      ++refine_expired_;
      continue;
    }
    if (done.improved) {
      entry->id = Intern(std::move(done.assignment), done.r, done.fallback_full_recompute);
      ++improved_;
    }
    entry->first_answer = false;
    entry->nearest = false;
    entry->refined = true;
    ++refined_;
  }
}

void StagePlanner::LandWarm(RefineDone& done) {
  --warm_in_flight_;
  ++warm_done_;
  warm_cpu_s_ += done.cpu_s;
  warm_submitted_[done.key] = true;
  if (done.expired || !done.improved) {  // a miss plans it as before
    if (shared_) shared_->Release(done.key);
    return;
  }
  const double r = static_cast<double>(done.key.load_bucket) * options_.load_bucket;
  if (shared_) {
    shared_->Publish(done.key,
                     SharedPlans::Entry{done.assignment, r, done.fallback_full_recompute});
  }
  CachedAssignment* entry = mitigation_cache_.Peek(done.key);
  // A miss met the key first and its full search (or refinement) already stands.
  if (entry != nullptr && !entry->first_answer) return;
  const int id = Intern(std::move(done.assignment), r, done.fallback_full_recompute);
  if (entry != nullptr) {  // a first answer: the warm plan if it is not costlier
    if (ExposedAt(id, done.key.share_bucket) > ExposedAt(entry->id, done.key.share_bucket)) return;
    entry->id = id;
    entry->first_answer = false;
    entry->nearest = false;
    entry->refined = true;
    if (!entry->warm) ++warm_live_;
    entry->warm = true;
    return;
  }
  CachedAssignment fresh;
  fresh.id = id;
  fresh.warm = true;
  mitigation_cache_.Insert(done.key, fresh);
  ++warm_live_;
}

void StagePlanner::WaitForRefinements() {
  if (refiner_) refiner_->WaitIdle();
  if (warm_refiner_) warm_refiner_->WaitIdle();
  ApplyRefinements();
}

Status StagePlanner::StartWarmup(int64_t host_limit_bytes, double bandwidth_share) {
  if (!warm_refiner_) {
    return FailedPrecondition("warm_up: the planner was created without the warm-up");
  }
  if (!std::isfinite(bandwidth_share) || bandwidth_share <= 0 || bandwidth_share > 1) {
    return InvalidArgument("bandwidth_share: must be in (0, 1], got " +
                           std::to_string(bandwidth_share));
  }
  if (host_limit_bytes < -1) {
    return InvalidArgument("host_limit_bytes: must be -1 (none) or >= 0, got " +
                           std::to_string(host_limit_bytes));
  }
  if (warm_started_) return OkStatus();
  warm_started_ = true;
  warm_host_limit_ = host_limit_bytes;
  warm_share_bucket_ = std::clamp(
      static_cast<int>(std::floor(bandwidth_share * kShareSteps + 1e-9)), 1, kShareSteps);
  WarmRound();
  return OkStatus();
}

void StagePlanner::WaitForWarmup() {
  if (!warm_started_) return;
  ApplyRefinements();  // starts the round a newly met budget asks for
  while (!warm_complete_ || warm_observed_new_ || warm_in_flight_ > 0) {
    warm_refiner_->WaitIdle();
    ApplyRefinements();
  }
}

void StagePlanner::WarmRound() {
  const std::vector<MitigationKey> keys =
      WarmKeys(warm_host_limit_, static_cast<double>(warm_share_bucket_) / kShareSteps);
  ++warm_rounds_;
  warm_found_.insert(keys.begin(), keys.end());
  const size_t cap = WarmCap();
  size_t submitted = 0;
  for (const MitigationKey& key : keys) {
    if (warm_submitted_.size() >= cap) break;
    if (!ClaimWarm(key)) continue;
    RefineJob job = JobFor(key);
    job.warm = true;
    warm_refiner_->Submit(std::move(job));
    ++warm_in_flight_;
    ++submitted;
  }
  if (submitted == 0) {
    warm_complete_ = true;  // nothing new (called with nothing in flight)
  } else if (warm_rounds_ >= static_cast<uint64_t>(options_.warm_rounds)) {
    warm_last_round_ = true;  // complete once these land
  }
}

void StagePlanner::ResetIteration() {
  for (UnitState& u : units_) u = UnitState{};
  tracker_ = BudgetTracker(m_max_, graph_.M0(1.0));
}

void StagePlanner::ClearCaches() {
  ++generation_;
  if (refiner_) refiner_->DropQueued();  // their keys are gone
  if (warm_refiner_) warm_refiner_->DropQueued();
  ShareWarmPlans(nullptr);  // the plans may no longer hold (a calibration change)
  mitigation_cache_.Clear();
  schedule_cache_.Clear();
  // The warm-up starts again at the next point (options_.warm_up).
  warm_started_ = warm_complete_ = warm_last_round_ = false;
  warm_submitted_.clear();
  warm_observed_.clear();
  warm_found_.clear();
  warm_observed_new_ = false;
  warm_in_flight_ = warm_live_ = 0;
}

Status StagePlanner::Validate(const SchedulePoint& p) const {
  const int mbs = static_cast<int>(config_.MicroBatches());
  const int chunks = static_cast<int>(config_.Chunks());
  auto check_unit = [&](int mb, int chunk, const char* mb_field, const char* chunk_field) {
    if (mb < -1 || mb >= mbs) {
      return InvalidArgument(std::string(mb_field) + ": " + std::to_string(mb) +
                             " is outside [0, " + std::to_string(mbs) + ") (or -1 for none)");
    }
    if (chunk < 0 || chunk >= chunks) {
      return InvalidArgument(std::string(chunk_field) + ": " + std::to_string(chunk) +
                             " is outside [0, " + std::to_string(chunks) + ")");
    }
    return OkStatus();
  };
  BGL_RETURN_IF_ERROR(
      check_unit(p.forward_micro_batch, p.forward_chunk, "forward_micro_batch", "forward_chunk"));
  BGL_RETURN_IF_ERROR(check_unit(p.backward_micro_batch, p.backward_chunk, "backward_micro_batch",
                                 "backward_chunk"));
  if (p.forward_micro_batch < 0 && p.backward_micro_batch < 0) {
    return InvalidArgument("forward_micro_batch: a point needs a forward or a backward");
  }
  if (!std::isfinite(p.load_factor) || p.load_factor <= 0 || p.load_factor > 64) {
    return InvalidArgument("load_factor: must be in (0, 64], got " + std::to_string(p.load_factor));
  }
  if (p.bytes_in_use < -1 || p.bytes_in_use > (int64_t{1} << 50)) {
    return InvalidArgument("bytes_in_use: out of range: " + std::to_string(p.bytes_in_use));
  }
  if (p.host_limit_bytes < -1 || p.host_limit_bytes > (int64_t{1} << 50)) {
    return InvalidArgument("host_limit_bytes: out of range (-1 for none): " +
                           std::to_string(p.host_limit_bytes));
  }
  if (!std::isfinite(p.bandwidth_share) || p.bandwidth_share <= 0 || p.bandwidth_share > 1) {
    return InvalidArgument("bandwidth_share: must be in (0, 1], got " +
                           std::to_string(p.bandwidth_share));
  }
  if (p.forward_micro_batch >= 0 && p.forward_micro_batch == p.backward_micro_batch &&
      p.forward_chunk == p.backward_chunk) {
    return InvalidArgument(
        "backward_micro_batch: a micro-batch's forward and backward never "
        "share a scheduling point");
  }
  return OkStatus();
}

int StagePlanner::Intern(Assignment assignment, double planned_r, bool fallback) {
  auto it = intern_index_.find(assignment);
  if (it != intern_index_.end()) return it->second;
  Interned entry;
  // Memory is affine in r for a fixed assignment: two evaluations give the line.
  const AssignmentCost at0 = eval_->Evaluate(assignment, 0.0);
  const AssignmentCost at1 = eval_->Evaluate(assignment, 1.0);
  entry.device_fixed = at0.device_bytes;
  entry.device_per_load = at1.device_bytes - at0.device_bytes;
  entry.host_fixed = at0.host_bytes;
  entry.host_per_load = at1.host_bytes - at0.host_bytes;
  entry.exposed_s = eval_->Evaluate(assignment, planned_r).exposed_s;
  entry.planned_r = planned_r;
  entry.fallback = fallback;
  entry.assignment = assignment;
  const int id = static_cast<int>(interned_.size());
  interned_.push_back(std::move(entry));
  intern_index_.emplace(std::move(assignment), id);
  return id;
}

const StagePlanner::CachedAssignment& StagePlanner::AssignmentFor(const MitigationKey& key,
                                                                  bool& hit) {
  if (const CachedAssignment* cached = mitigation_cache_.Find(key)) {
    hit = true;
    return *cached;
  }
  if (const CachedAssignment* cached = FromShared(key)) {
    hit = true;  // a hit of the shared cache
    return *cached;
  }
  hit = false;
  RefineJob job = JobFor(key);
  // The anytime path: the first answer now, the full search on the refiner's thread.
  MitigationOptions first = job.options;
  first.fast = anytime_;
  auto selected = SelectMitigation(EvaluatorFor(key.share_bucket), job.r, job.budget, first);
  CachedAssignment entry;
  entry.first_answer = selected.ok() && selected->first_answer;
  entry.id = selected.ok()
                 ? Intern(std::move(selected->assignment), job.r, selected->fallback_full_recompute)
                 : Intern(FullRecompute(*eval_), job.r, true);
  double first_exposed_s = selected.ok() ? selected->cost.exposed_s : 0;
  if (entry.first_answer && warm_refiner_) {
    // The warm-up's plans (and the refined misses') of the neighbouring keys: the cheapest that
    // fits serves the key in place of its first answer when it costs no more (issue 43: the
    // points after a spike meet budget and load buckets the warm-up has not reached yet).
    double exposed_s = 0;
    const int nearest = NearestPlan(key, job, first_exposed_s, exposed_s);
    if (nearest >= 0) {
      entry.id = nearest;
      entry.nearest = true;
      first_exposed_s = exposed_s;
      ++warm_nearest_;
    }
  }
  if (entry.first_answer && refiner_ && options_.refine_first_answers) {
    job.first_answer = interned_[entry.id].assignment;
    job.first_exposed_s = first_exposed_s;
    refiner_->Submit(std::move(job));
    ++first_answers_;
  }
  return mitigation_cache_.Insert(key, entry);
}

std::vector<int> StagePlanner::PlansNear(const MitigationKey& key,
                                         const std::function<bool(const Interned&)>& keep) {
  MitigationKey lo;
  lo.valid = key.valid;
  lo.phase = key.phase;
  lo.chunk = key.chunk;
  lo.budget_bucket = key.budget_bucket - kNearestBudgets;
  lo.load_bucket = std::numeric_limits<int64_t>::min();
  lo.host_bucket = std::numeric_limits<int64_t>::min();
  lo.share_bucket = std::numeric_limits<int>::min();
  MitigationKey hi = lo;
  hi.budget_bucket = key.budget_bucket + kNearestBudgets + 1;
  std::vector<std::pair<int64_t, int>> near;  // (distance in buckets, interned id)
  mitigation_cache_.ForEachIn(lo, hi, [&](const MitigationKey& k, const CachedAssignment& c) {
    if (c.first_answer) return;  // full searches only (warm, refined or searched on the call)
    if (!keep(interned_[c.id])) return;
    near.emplace_back(
        std::abs(k.budget_bucket - key.budget_bucket) + std::abs(k.load_bucket - key.load_bucket),
        c.id);
  });
  std::sort(near.begin(), near.end());
  std::vector<int> out;
  for (const auto& [distance, id] : near) {
    if (std::find(out.begin(), out.end(), id) != out.end()) continue;
    if (out.size() >= kNearestPlans) break;
    out.push_back(id);
  }
  return out;
}

int StagePlanner::NearestPlan(const MitigationKey& key, const RefineJob& job, double bound_s,
                              double& exposed_s) {
  // Those that fit at this key's load by the memory line of each interned plan.
  const std::vector<int> near = PlansNear(key, [&](const Interned& a) {
    return !a.fallback && a.device_fixed + a.device_per_load * job.r <= job.budget &&
           job.options.HostFits(a.host_fixed + a.host_per_load * job.r);
  });
  int best = -1;
  CostEvaluator& eval = EvaluatorFor(key.share_bucket);
  for (const int id : near) {
    const AssignmentCost cost = eval.Evaluate(interned_[id].assignment, job.r);
    if (cost.conflict || cost.device_bytes > job.budget || !job.options.HostFits(cost.host_bytes) ||
        cost.exposed_s > bound_s) {
      continue;
    }
    best = id;
    bound_s = exposed_s = cost.exposed_s;
  }
  return best;
}

RefineJob StagePlanner::JobFor(const MitigationKey& key) {
  // Plan for the worst case of the bucket: the lowest budget, the highest load, the lowest host
  // limit and the lowest bandwidth share in it.
  RefineJob job;
  job.key = key;
  job.generation = generation_;
  job.r = static_cast<double>(key.load_bucket) * options_.load_bucket;
  job.budget = std::max(graph_.M0(job.r), static_cast<double>(key.budget_bucket) *
                                              static_cast<double>(options_.budget_step_bytes));
  job.options = options_.mitigation;
  if (key.host_bucket >= 0) {
    job.options.host_limit_bytes =
        static_cast<double>(key.host_bucket) * static_cast<double>(options_.budget_step_bytes);
  }
  job.hw = EvaluatorFor(key.share_bucket).hw();
  return job;
}

std::vector<MitigationKey> StagePlanner::WarmKeys(int64_t host_limit_bytes,
                                                  double bandwidth_share) {
  const double lb = options_.load_bucket;
  const double step = static_cast<double>(options_.budget_step_bytes);
  const int share_bucket = std::clamp(
      static_cast<int>(std::floor(bandwidth_share * kShareSteps + 1e-9)), 1, kShareSteps);
  const int64_t host_bucket =
      host_limit_bytes < 0 ? -1 : host_limit_bytes / options_.budget_step_bytes;
  // A copy: the replay may intern shared plans (FromShared), which moves interned_.
  const Interned keep_all = interned_[keep_all_];
  std::vector<MitigationKey> out;
  std::map<MitigationKey, bool> seen;
  // One iteration with micro-batch `spiked` at load `spike` (-1: none), the others at 1: the
  // keys of its forwards, each forward retaining what the cached plan for its key predicts (its
  // memory line, reported as PlanPoint's callers do), else min(budget, keep-all).
  auto replay = [&](int spiked, double spike) {
    BudgetTracker tracker(m_max_, graph_.M0(1.0));
    for (size_t i = 0; i < steps_.size(); ++i) {
      const Step& s = steps_[i];
      if (!s.forward) {
        tracker.OnBackward(s.micro_batch, s.chunk);
        continue;
      }
      const double r = s.micro_batch == spiked ? spike : 1.0;
      const BudgetDecision d = tracker.OnForward(ForwardsUntilNextBackward(steps_, i));
      double retained = keep_all.device_fixed + keep_all.device_per_load * r;
      if (d.budget < retained) {
        MitigationKey key;
        key.valid = true;
        key.phase = static_cast<int>(s.phase);
        key.chunk = s.chunk;
        key.budget_bucket = static_cast<int64_t>(std::floor(d.budget / step));
        key.load_bucket = static_cast<int64_t>(std::ceil(r / lb - 1e-9));
        key.host_bucket = host_bucket;
        key.share_bucket = share_bucket;
        if (seen.emplace(key, true).second) out.push_back(key);
        const CachedAssignment* cached = mitigation_cache_.Peek(key);
        if (cached == nullptr) cached = FromShared(key);
        if (cached != nullptr) {
          const Interned& a = interned_[cached->id];
          retained = a.device_fixed + a.device_per_load * r;
        } else {
          retained = d.budget;
        }
      }
      tracker.OnReport(s.micro_batch, s.chunk, std::floor(retained));
    }
  };
  replay(-1, 1.0);
  const auto first = static_cast<int64_t>(std::ceil(1.0 / lb - 1e-9));
  const auto last = static_cast<int64_t>(std::ceil(options_.warm_spike_bound / lb - 1e-9));
  const int micro_batches = static_cast<int>(config_.MicroBatches());
  for (int64_t bucket = first + 1; bucket <= last; ++bucket) {
    for (int mb = 0; mb < micro_batches; ++mb) replay(mb, static_cast<double>(bucket) * lb);
  }
  return out;
}

CostEvaluator& StagePlanner::EvaluatorFor(int share_bucket) {
  if (share_bucket >= kShareSteps) return *eval_;
  std::unique_ptr<ShareModel>& model = share_models_[share_bucket];
  if (!model) {
    model = std::make_unique<ShareModel>();
    model->hw = hw_;
    const double share = static_cast<double>(share_bucket) / kShareSteps;
    model->hw.offload.peak_bytes_per_s *= share;
    model->hw.reload.peak_bytes_per_s *= share;
    model->eval = std::make_unique<CostEvaluator>(graph_, model->hw);
    model->eval->set_deadline(eval_->deadline());
  }
  return *model->eval;
}

double StagePlanner::ExposedAt(int id, int share_bucket) {
  Interned& entry = interned_[id];
  if (share_bucket >= kShareSteps) return entry.exposed_s;
  auto it = entry.exposed_at_share.find(share_bucket);
  if (it != entry.exposed_at_share.end()) return it->second;
  const double exposed =
      EvaluatorFor(share_bucket).Evaluate(entry.assignment, entry.planned_r).exposed_s;
  entry.exposed_at_share.emplace(share_bucket, exposed);
  return exposed;
}

namespace {

// The budget buckets on each side of a met one that the warm-up also plans.
constexpr int64_t kWarmBudgetsBeside = 1;

int ShareBucket(double share) {
  return std::clamp(static_cast<int>(std::floor(share * kShareSteps + 1e-9)), 1, kShareSteps);
}

}  // namespace

template <typename F>
Result<Plan> StagePlanner::WithDeadline(const Deadline& deadline, F&& plan) {
  if (deadline.Unlimited()) return plan();
  // Snapshots only when a deadline can fire, so the planner's own latency is unchanged.
  const BudgetTracker tracker = tracker_;
  const std::vector<UnitState> units = units_;
  auto set_deadline = [&](const Deadline* d) {
    eval_->set_deadline(d);
    for (auto& [bucket, model] : share_models_) model->eval->set_deadline(d);
  };
  set_deadline(&deadline);
  try {
    Result<Plan> result = plan();
    set_deadline(nullptr);
    return result;
  } catch (const detail::DeadlineExpired&) {
    set_deadline(nullptr);
    tracker_ = tracker;
    units_ = units;
    return deadline.ToStatus();
  }
}

Result<Plan> StagePlanner::PlanPoint(const SchedulePoint& point, const Deadline& deadline) {
  BGL_RETURN_IF_ERROR(Validate(point));
  if (options_.warm_up && !warm_started_ && point.forward_micro_batch >= 0) {
    BGL_RETURN_IF_ERROR(StartWarmup(point.host_limit_bytes, point.bandwidth_share));
  }
  ApplyRefinements();
  (void)EvaluatorFor(ShareBucket(point.bandwidth_share));  // created before the deadline is set
  return WithDeadline(deadline, [&] { return PlanPointUnchecked(point, deadline); });
}

Result<Plan> StagePlanner::PlanPointUnchecked(const SchedulePoint& point,
                                              const Deadline& deadline) {
  Plan plan;
  plan.m0_bytes = static_cast<int64_t>(graph_.M0(point.load_factor));
  plan.load_factor = point.load_factor;
  const int share_bucket = ShareBucket(point.bandwidth_share);
  plan.bandwidth_share = static_cast<double>(share_bucket) / kShareSteps;
  if (point.bytes_in_use >= 0) tracker_.Rebase(static_cast<double>(point.bytes_in_use));
  bool hit_mitigation = true;
  if (point.forward_micro_batch >= 0) {
    const int unit_index = UnitIndex(point.forward_micro_batch, point.forward_chunk);
    const int index = forward_step_[unit_index];
    plan.phase = point.phase.value_or(steps_[index].phase);
    plan.micro_batch = point.forward_micro_batch;
    plan.chunk = point.forward_chunk;
    const BudgetDecision d = tracker_.OnForward(ForwardsUntilNextBackward(steps_, index));
    plan.budget_bytes = static_cast<int64_t>(d.budget);
    plan.free_bytes = static_cast<int64_t>(d.free);
    plan.k = d.k;
    plan.infeasible = d.infeasible;
    MitigationKey key;
    key.valid = true;
    key.phase = static_cast<int>(plan.phase);
    key.chunk = point.forward_chunk;
    key.budget_bucket = static_cast<int64_t>(
        std::floor(d.budget / static_cast<double>(options_.budget_step_bytes)));
    key.load_bucket =
        static_cast<int64_t>(std::ceil(point.load_factor / options_.load_bucket - 1e-9));
    // Rounded down to the budget step: the plan never offloads more than the limit.
    key.host_bucket =
        point.host_limit_bytes < 0 ? -1 : point.host_limit_bytes / options_.budget_step_bytes;
    key.share_bucket = share_bucket;
    const auto load_one = static_cast<int64_t>(std::ceil(1.0 / options_.load_bucket - 1e-9));
    if (options_.warm_up && key.load_bucket < load_one) {
      // A load below 1 is served the cached full-search plan of load 1 at its budget (the
      // warm-up's or a refined miss's; a plan for a higher load fits a lower one): the warm-up
      // plans from load 1 up, and a training run's predicted loads fall below 1 about as often
      // as above (docs/benchmarks/planner.md "The warm-up"). Else the point's own key.
      MitigationKey one = key;
      one.load_bucket = load_one;
      const CachedAssignment* cached = mitigation_cache_.Peek(one);
      if (cached == nullptr) cached = FromShared(one);
      if (cached != nullptr && !cached->first_answer) key = one;
    }
    // A budget that holds every saved tensor needs no mitigation; the bucket's floor (the
    // budget rounded down to the step) must not turn it into one.
    const Interned& keep_all = interned_[keep_all_];  // its memory line: keep-all at any r
    const bool fits_all =
        d.budget >= keep_all.device_fixed + keep_all.device_per_load * point.load_factor;
    int id = keep_all_;
    if (!fits_all) {
      if (warm_refiner_) {
        // The warm-up's next round covers this budget at every load, and the buckets beside
        // it: the bytes a spiked micro-batch holds move the points after it by a bucket or so
        // from the budgets met so far (docs/benchmarks/planner.md "The warm-up").
        for (int64_t beside = -kWarmBudgetsBeside; beside <= kWarmBudgetsBeside; ++beside) {
          MitigationKey met = key;
          met.load_bucket = 0;
          met.budget_bucket += beside;
          if (met.budget_bucket < 0) continue;
          if (warm_observed_.insert(met).second) warm_observed_new_ = true;
        }
      }
      const CachedAssignment& cached = AssignmentFor(key, hit_mitigation);
      id = cached.id;
      plan.first_answer = cached.first_answer && !cached.nearest;
      plan.nearest = cached.nearest;
      plan.refined = cached.refined;
      plan.warm = cached.warm;
      if (hit_mitigation && cached.warm) ++warm_hits_;
      if (hit_mitigation && cached.shared) ++warm_shared_hits_;
    }
    const Interned& a = interned_[id];
    plan.strategies = a.assignment;
    plan.fallback_full_recompute = a.fallback;
    const double predicted = a.device_fixed + a.device_per_load * point.load_factor;
    plan.predicted_bytes = static_cast<int64_t>(predicted);
    plan.host_bytes = static_cast<int64_t>(a.host_fixed + a.host_per_load * point.load_factor);
    plan.overhead_s = ExposedAt(id, share_bucket);
    plan.keep_all_bytes = static_cast<int64_t>(graph_.KeepAllBytes(point.load_factor));
    UnitState& unit = units_[unit_index];
    unit.live = true;
    unit.assignment = id;
    unit.load = point.load_factor;
    unit.budget = d.budget;
    unit.host_limit = static_cast<double>(point.host_limit_bytes);
    unit.share_bucket = share_bucket;
    // The prediction stands in for the report until the real number arrives.
    tracker_.OnReport(point.forward_micro_batch, point.forward_chunk, predicted);
  } else {
    plan.phase = point.phase.value_or(Phase::kCooldown);
  }
  FillSchedule(plan, point.forward_micro_batch, point.forward_chunk, point.backward_micro_batch,
               point.backward_chunk, share_bucket, /*use_cache=*/true, deadline);
  plan.cache_hit = hit_mitigation && plan.cache_hit;
  if (point.backward_micro_batch >= 0) {
    tracker_.OnBackward(point.backward_micro_batch, point.backward_chunk);
    units_[UnitIndex(point.backward_micro_batch, point.backward_chunk)] = UnitState{};
  }
  return plan;
}

void StagePlanner::FillSchedule(Plan& plan, int f_mb, int f_chunk, int b_mb, int b_chunk,
                                int share_bucket, bool use_cache, const Deadline& deadline) {
  // O is the forward before this one; R the backward after this one.
  const int f_unit = f_mb >= 0 ? UnitIndex(f_mb, f_chunk) : -1;
  const int b_unit = b_mb >= 0 ? UnitIndex(b_mb, b_chunk) : -1;
  const int units[kChainCount] = {f_unit, b_unit, f_unit >= 0 ? previous_forward_[f_unit] : -1,
                                  b_unit >= 0 ? next_backward_[b_unit] : -1};
  ScheduleKey key;
  key.share_bucket = share_bucket;
  const Assignment* assignments[kChainCount] = {};
  double loads[kChainCount] = {1, 1, 1, 1};
  for (int c = 0; c < kChainCount; ++c) {
    if (units[c] < 0) continue;
    const UnitState& u = units_[units[c]];
    // A unit this planner did not plan (e.g. it started mid-iteration) is assumed kept whole.
    const int id = u.live ? u.assignment : keep_all_;
    const double load = u.live ? u.load : 1.0;
    key.units[c].chunk = static_cast<int>(units[c] % config_.Chunks());
    key.units[c].assignment = id;
    key.units[c].load_class =
        static_cast<int64_t>(std::ceil(load / options_.schedule_load_class - 1e-9));
    assignments[c] = &interned_[id].assignment;
    // Durations are taken at the top of the load class, so a cached order is never optimistic.
    loads[c] = static_cast<double>(key.units[c].load_class) * options_.schedule_load_class;
  }
  const DualBatchSchedule* schedule = use_cache ? schedule_cache_.Find(key) : nullptr;
  plan.cache_hit = schedule != nullptr;
  DualBatchSchedule computed;
  if (!schedule) {
    PointUnits point_units;
    point_units.offload_chunk_bytes = options_.offload_chunk_bytes;
    point_units.forward = assignments[0];
    point_units.forward_r = loads[0];
    point_units.backward = assignments[1];
    point_units.backward_r = loads[1];
    point_units.offload = assignments[2];
    point_units.offload_r = loads[2];
    point_units.recover = assignments[3];
    point_units.recover_r = loads[3];
    const Chains chains = BuildChains(EvaluatorFor(share_bucket), point_units);
    switch (options_.issue_policy) {
      case IssuePolicy::kDualBatch:
        computed = SolveDualBatch(chains, &deadline);
        break;
      case IssuePolicy::kLockstep:
        computed = LockstepSchedule(chains);
        break;
      case IssuePolicy::kSerial:
        computed = SerialSchedule(chains);
        break;
    }
    for (size_t r = 0; r < computed.rounds.size(); ++r) {
      for (int c = 0; c < kChainCount; ++c) {
        const int stage = computed.rounds[r].stage[c];
        if (stage < 0) continue;
        const ChainStage& s = chains[c][stage];
        computed.issue_order.push_back({static_cast<Chain>(c), stage, static_cast<int>(r),
                                        s.resource, s.duration_s, s.first, s.last});
      }
    }
    schedule = use_cache ? &schedule_cache_.Insert(key, std::move(computed)) : &computed;
  }
  plan.serial_s = schedule->serial_s;
  plan.overlapped_s = schedule->overlapped_s;
  plan.issue_order = schedule->issue_order;
}

Result<Plan> StagePlanner::PlanAfterGate(int micro_batch, int chunk, int gate_layer,
                                         double observed_r, const Deadline& deadline) {
  return WithDeadline(deadline, [&] {
    return PlanAfterGateUnchecked(micro_batch, chunk, gate_layer, observed_r, deadline);
  });
}

Result<Plan> StagePlanner::PlanAfterGateUnchecked(int micro_batch, int chunk, int gate_layer,
                                                  double observed_r, const Deadline& deadline) {
  const int mbs = static_cast<int>(config_.MicroBatches());
  const int chunks = static_cast<int>(config_.Chunks());
  if (micro_batch < 0 || micro_batch >= mbs || chunk < 0 || chunk >= chunks ||
      !units_[UnitIndex(micro_batch, chunk)].live) {
    return NotFound("micro_batch: (" + std::to_string(micro_batch) + ", chunk " +
                    std::to_string(chunk) + ") has no forward plan to revise");
  }
  if (gate_layer < 0 || gate_layer >= graph_.layers) {
    return InvalidArgument("gate_layer: " + std::to_string(gate_layer) + " is outside [0, " +
                           std::to_string(graph_.layers) + ")");
  }
  if (!std::isfinite(observed_r) || observed_r <= 0 || observed_r > 64) {
    return InvalidArgument("load_factor: must be in (0, 64], got " + std::to_string(observed_r));
  }
  UnitState& unit = units_[UnitIndex(micro_batch, chunk)];
  CostEvaluator& eval = EvaluatorFor(unit.share_bucket);
  // The unit's plan at the observed load, as the tracker learns it.
  auto revision = [&](const Assignment& strategies, const AssignmentCost& cost) {
    unit.load = observed_r;
    tracker_.OnReport(micro_batch, chunk, cost.device_bytes);
    Plan plan;
    plan.phase = steps_[forward_step_[UnitIndex(micro_batch, chunk)]].phase;
    plan.micro_batch = micro_batch;
    plan.chunk = chunk;
    plan.load_factor = observed_r;
    plan.budget_bytes = static_cast<int64_t>(unit.budget);
    plan.m0_bytes = static_cast<int64_t>(graph_.M0(observed_r));
    plan.keep_all_bytes = static_cast<int64_t>(graph_.KeepAllBytes(observed_r));
    plan.predicted_bytes = static_cast<int64_t>(cost.device_bytes);
    plan.host_bytes = static_cast<int64_t>(cost.host_bytes);
    plan.strategies = strategies;
    plan.overhead_s = cost.exposed_s;
    plan.bandwidth_share = static_cast<double>(unit.share_bucket) / kShareSteps;
    return plan;
  };
  {
    // The plan still fits at the observed load (the common case: a router a few percent over
    // the load its point planned for): nothing to revise, so no warm lookup and no issue order
    // (a full schedule costs milliseconds on the training thread); deferred stays false and
    // the caller keeps the plan and order it has.
    const Assignment& planned = interned_[unit.assignment].assignment;
    const AssignmentCost now = eval.Evaluate(planned, observed_r);
    const bool host_ok = unit.host_limit < 0 || now.host_bytes <= unit.host_limit;
    if (now.device_bytes <= unit.budget && host_ok) return revision(planned, now);
  }
  // With the warm-up, the cached full-search plans of the whole chunk near the observed load
  // and the point's budget (the warm-up's, refined misses') are alternatives too.
  std::vector<Assignment> warm;
  if (options_.warm_up) {
    MitigationKey key;
    key.valid = true;
    key.phase = static_cast<int>(steps_[forward_step_[UnitIndex(micro_batch, chunk)]].phase);
    key.chunk = chunk;
    key.budget_bucket = static_cast<int64_t>(
        std::floor(unit.budget / static_cast<double>(options_.budget_step_bytes)));
    key.load_bucket = static_cast<int64_t>(std::ceil(observed_r / options_.load_bucket - 1e-9));
    for (const int id : PlansNear(key, [](const Interned& a) { return !a.fallback; })) {
      warm.push_back(interned_[id].assignment);
    }
  }
  // The search's price at this gate: what the earlier searches here took per label. A skipped
  // search lowers it by a tenth, so one slow measurement (a preempted thread) does not stop the
  // searches at this gate for good: a later one runs, with fewer labels, and measures again.
  if (gate_search_s_per_label_.size() != static_cast<size_t>(graph_.layers)) {
    gate_search_s_per_label_.assign(static_cast<size_t>(graph_.layers), 0.0);
  }
  double& per_label = gate_search_s_per_label_[static_cast<size_t>(gate_layer)];
  GateSearch search;
  search.share = options_.gate_search_share;
  search.seconds_per_label = per_label;
  const MitigationResult revised =
      ReplanAfterGate(eval, interned_[unit.assignment].assignment, gate_layer, observed_r,
                      unit.budget, unit.host_limit, options_.mitigation, &warm, search);
  if (revised.search_labels > 0) {
    const double measured = revised.search_s / revised.search_labels;
    per_label = per_label > 0 ? 0.5 * (per_label + measured) : measured;
    ++gate_searches_;
    gate_search_s_ += revised.search_s;
  } else if (revised.search_cut) {
    per_label *= 0.9;
  }
  gate_searches_cut_ += revised.search_cut ? 1 : 0;
  unit.assignment = Intern(revised.assignment, observed_r, revised.fallback_full_recompute);
  Plan plan = revision(revised.assignment, revised.cost);
  plan.fallback_full_recompute = revised.fallback_full_recompute;
  plan.infeasible = !revised.fits;
  plan.deferred = true;
  FillSchedule(plan, micro_batch, chunk, -1, 0, unit.share_bucket, /*use_cache=*/false, deadline);
  return plan;
}

Status StagePlanner::Report(int micro_batch, int chunk, int64_t actual_bytes) {
  if (actual_bytes < 0) {
    return InvalidArgument("actual_bytes: must be non-negative, got " +
                           std::to_string(actual_bytes));
  }
  if (micro_batch < 0 || micro_batch >= static_cast<int>(config_.MicroBatches()) || chunk < 0 ||
      chunk >= static_cast<int>(config_.Chunks()) || !units_[UnitIndex(micro_batch, chunk)].live) {
    return NotFound("micro_batch: (" + std::to_string(micro_batch) + ", chunk " +
                    std::to_string(chunk) + ") was not planned or its backward already ran");
  }
  tracker_.OnReport(micro_batch, chunk, static_cast<double>(actual_bytes));
  return OkStatus();
}

}  // namespace bgl::plan
