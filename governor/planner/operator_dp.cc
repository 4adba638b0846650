#include "governor/planner/operator_dp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace bgl::plan {

namespace {

// What the decided operators contribute. `mem` excludes the always retained tensors (M0).
struct Terms {
  double mem = 0;
  double local = 0;  // recompute + FP8 seconds
  double d2h = 0;
  double h2d = 0;
  double host = 0;
};

struct Label {
  Terms terms;
  uint64_t sig = 0;  // 3 bits per open tensor: saver strategy code (2 bits), needed bit
  int parent = -1;
  Strategy strategy = Strategy::kKeep;
};

constexpr int kSlotBits = 3;
constexpr int kMaxSlots = 64 / kSlotBits;  // 21
constexpr uint8_t kNeeded = 4;

uint8_t Code(Strategy s) {
  switch (s) {
    case Strategy::kKeep:
      return 1;
    case Strategy::kOffload:
      return 2;
    case Strategy::kFp8:
      return 3;
    case Strategy::kRecompute:
      return 0;
  }
  return 0;
}

// A fractional knapsack of what the operators still to decide can shed: items (bytes at a price
// in seconds per byte, each of one producer) sorted by price once, in Fenwick trees of bytes and
// seconds; the DP removes a producer's items as it decides it. O(log items) a removal and a query.
class Knapsack {
 public:
  struct Item {
    double rate, cap;  // seconds per byte shed, bytes
    int producer;      // -1: a tensor from outside the chunk
  };

  // The items of the producers before `below` (-1: from outside the chunk, always in).
  Knapsack(const std::vector<Item>& items, int below) {
    for (const Item& x : items) {
      if (x.producer < below) items_.push_back(x);
    }
    std::sort(items_.begin(), items_.end(),
              [](const Item& a, const Item& b) { return a.rate < b.rate; });
    const size_t m = items_.size();
    bytes_.assign(m + 1, 0);
    seconds_.assign(m + 1, 0);
    for (size_t i = 0; i < m; ++i) Update(i, items_[i].cap);
    // by_producer_: the items' indices grouped by producer, from_[p + 1] where p's begin
    from_.assign(static_cast<size_t>(std::max(below, 0)) + 2, 0);
    for (const Item& x : items_) ++from_[static_cast<size_t>(x.producer + 1) + 1];
    for (size_t q = 1; q < from_.size(); ++q) from_[q] += from_[q - 1];
    by_producer_.resize(m);
    std::vector<size_t> at(from_.begin(), from_.end() - 1);
    for (size_t i = 0; i < m; ++i)
      by_producer_[at[static_cast<size_t>(items_[i].producer + 1)]++] = i;
    top_ = 1;
    while (top_ * 2 <= m) top_ *= 2;
  }

  void RemoveProducer(int producer) {
    const auto q = static_cast<size_t>(producer + 1);
    if (q + 1 >= from_.size()) return;
    for (size_t k = from_[q]; k < from_[q + 1]; ++k) {
      const size_t i = by_producer_[k];
      Update(i, -items_[i].cap);
    }
  }

  // The least seconds that shed `bytes`, the cheapest items first; infinity past what they hold.
  double Fill(double bytes) const {
    size_t pos = 0;
    double left = bytes, seconds = 0;
    for (size_t step = top_; step > 0; step /= 2) {
      if (pos + step < bytes_.size() && bytes_[pos + step] < left) {
        pos += step;
        left -= bytes_[pos];
        seconds += seconds_[pos];
      }
    }
    if (pos >= items_.size()) return left > 0 ? std::numeric_limits<double>::infinity() : seconds;
    return seconds + std::max(left, 0.0) * items_[pos].rate;
  }

  // The bytes and seconds of all the items cheaper than `rate`.
  std::pair<double, double> Below(double rate) const {
    size_t end =
        static_cast<size_t>(std::lower_bound(items_.begin(), items_.end(), rate,
                                             [](const Item& a, double r) { return a.rate < r; }) -
                            items_.begin());
    double bytes = 0, seconds = 0;
    for (; end > 0; end &= end - 1) {
      bytes += bytes_[end];
      seconds += seconds_[end];
    }
    return {bytes, seconds};
  }

 private:
  void Update(size_t i, double cap) {
    const double seconds = cap * items_[i].rate;
    for (size_t j = i + 1; j < bytes_.size(); j += j & (~j + 1)) {
      bytes_[j] += cap;
      seconds_[j] += seconds;
    }
  }

  std::vector<Item> items_;
  std::vector<double> bytes_, seconds_;  // Fenwick trees, 1-based
  std::vector<size_t> by_producer_, from_;
  size_t top_ = 1;
};

// The graph's costs at one load factor, and for every cut the tensors open there.
class Problem {
 public:
  Problem(const CostEvaluator& eval, double r, const MitigationOptions& options,
          const Pinned* pinned)
      : g_(eval.graph()) {
    const HardwareProfile& hw = eval.hw();
    const size_t n = g_.ops.size(), nt = g_.tensors.size();
    tensors_.resize(nt);
    std::vector<int> last_touch(nt, -1);
    for (size_t t = 0; t < nt; ++t) {
      const SavedTensor& x = g_.tensors[t];
      TensorCost& y = tensors_[t];
      const double b = x.Bytes(r);
      y.bytes = b;
      y.fp8_bytes = CostEvaluator::Fp8Bytes(b, x.dtype);
      y.fp8_s = 2 * hw.fp8_cast.Time(b);
      y.d2h_s = hw.offload.Time(b);
      y.h2d_s = hw.reload.Time(b);
      y.copy_host_s = hw.CopyHostTime();
      y.skip = x.block_input;
      y.saved = !x.savers.empty();
      y.always_retained = x.block_input || x.producer < 0;
      for (int s : x.savers) last_touch[t] = std::max(last_touch[t], s);
    }
    ops_.resize(n);
    for (size_t o = 0; o < n; ++o) {
      const Operator& op = g_.ops[o];
      OpInfo& info = ops_[o];
      info.forward_s = hw.RerunTime(op.ForwardTime(r));
      if (pinned != nullptr && pinned->pinned[o]) {
        info.choices.push_back(pinned->strategies[o]);  // as it ran, whatever the options say
      } else {
        for (Strategy s : kAllStrategies) {
          if (options.Permits(s) && eval.Allowed(static_cast<int>(o), s)) {
            info.choices.push_back(s);
          }
        }
      }
      for (int t : op.saves) {
        if (!tensors_[t].skip) info.saves.push_back(t);
      }
      for (int t : op.inputs) {
        if (!tensors_[t].always_retained) info.inputs.push_back(t);
        last_touch[t] = std::max(last_touch[t], static_cast<int>(o));
      }
    }
    for (size_t t = 0; t < nt; ++t) {
      if (tensors_[t].skip) continue;
      const int p = g_.tensors[t].producer;
      if (p >= 0) {
        ops_[p].outputs.push_back(static_cast<int>(t));
      } else if (tensors_[t].saved) {
        externals_.push_back(static_cast<int>(t));
      }
    }
    // open[c]: tensors produced before operator c (or outside the chunk) and touched at or
    // after it; the slots of the signature at cut c.
    open_.resize(n + 1);
    for (size_t c = 0; c <= n; ++c) {
      for (size_t t = 0; t < nt; ++t) {
        if (tensors_[t].skip) continue;
        const int p = g_.tensors[t].producer;
        if (p < static_cast<int>(c) && last_touch[t] >= static_cast<int>(c)) {
          open_[c].push_back(static_cast<int>(t));
        }
      }
      max_open_ = std::max(max_open_, open_[c].size());
    }
    // What the operators still to decide (those before a cut) add for certain: a tensor they
    // produce (or one from outside the chunk) whose savers are all pinned is placed as those
    // savers agree, whatever the free operators do. fixed_[c]: the sum over the tensors produced
    // before operator c; a label whose terms plus it pass the budget or the bound is cut (issue
    // 43: in the revision after the gate the operators that ran hold most of the bytes).
    fixed_.assign(n + 1, Terms{});
    std::vector<char> fixed_tensor(nt, 0);
    if (pinned != nullptr) {
      std::vector<Terms> by_producer(n + 1);  // index producer + 1 (0: outside the chunk)
      for (size_t t = 0; t < nt; ++t) {
        if (tensors_[t].skip || !tensors_[t].saved) continue;
        uint8_t m = 0;
        bool fixed = true;
        for (int saver : g_.tensors[t].savers) {
          if (!pinned->pinned[saver]) {
            fixed = false;
            break;
          }
          const uint8_t code = Code(pinned->strategies[saver]);
          if (code == 0) continue;
          if (m != 0 && m != code) {
            fixed = false;  // a conflict: the DP drops such a label itself
            break;
          }
          m = code;
        }
        if (fixed) {
          Place(static_cast<int>(t), m, by_producer[g_.tensors[t].producer + 1]);
          fixed_tensor[t] = 1;
        }
      }
      // fixed_[c] = outside the chunk + producers 0 .. c-1 for c >= 1; fixed_[0] stays empty
      // (deciding operator 0 places the tensors from outside).
      Terms sum = by_producer[0];
      for (size_t c = 1; c <= n; ++c) {
        Add(by_producer[c], sum);
        fixed_[c] = sum;
      }
    }
    // The compute the copies hide under (none where they are synchronous: copy_overlap 0).
    forward_s_ = hw.copy_overlap * g_.ForwardTime(r);
    backward_s_ = hw.copy_overlap * g_.BackwardTime(r);
    fixed_tensor_ = std::move(fixed_tensor);
  }

  // What the tensors the operators before a cut place (and the tensors from outside the chunk)
  // can shed and at what price: the operators decided last to first, a label at cut c has placed
  // none of them yet. A relaxation of the choices (each tensor may shed its bytes by an offload,
  // by FP8 and by its producer's rerun at once, whatever its savers can agree on), so `Extra` is a
  // lower bound of what they add to the exposed overhead. items: the FP8 casts and the reruns
  // (Knapsack); cuts: per cut, the bytes to place and the offloads' bytes and cheapest rates.
  // The DP builds it once, where a front first passes its cap (most searches never need it).
  struct Cut {
    double bytes = 0, offloadable = 0, d2h_rate = 0, h2d_rate = 0;
  };
  struct Shedding {
    std::vector<Knapsack::Item> items;
    std::vector<Cut> cuts;
  };
  Shedding MakeShedding() const {
    Shedding out;
    const size_t n = ops_.size();
    // the tensors' indices grouped by producer + 1 (0: from outside the chunk)
    std::vector<int> from(n + 3, 0), order(tensors_.size());
    auto counts = [&](size_t t) {
      const TensorCost& y = tensors_[t];
      return !(y.skip || !y.saved || fixed_tensor_[t] || !(y.bytes > 0));
    };
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (counts(t)) ++from[static_cast<size_t>(g_.tensors[t].producer + 2)];
    }
    for (size_t q = 1; q < from.size(); ++q) from[q] += from[q - 1];
    std::vector<int> at(from.begin(), from.end() - 1);
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (counts(t)) {
        order[static_cast<size_t>(at[static_cast<size_t>(g_.tensors[t].producer + 1)]++)] =
            static_cast<int>(t);
      }
    }
    out.cuts.assign(n + 1, Cut{});
    Cut sum;
    sum.d2h_rate = sum.h2d_rate = std::numeric_limits<double>::infinity();
    for (size_t c = 0; c <= n; ++c) {
      // cut c >= 1: the tensors from outside and those of the producers 0 .. c-1
      const int producer = static_cast<int>(c) - 1;
      double rerun_cap = 0;
      for (int k = from[c]; k < from[c + 1]; ++k) {
        const int t = order[static_cast<size_t>(k)];
        const TensorCost& y = tensors_[static_cast<size_t>(t)];
        bool offload = false, fp8 = false;
        for (int saver : g_.tensors[static_cast<size_t>(t)].savers) {
          for (Strategy s : ops_[static_cast<size_t>(saver)].choices) {
            offload |= s == Strategy::kOffload;
            fp8 |= s == Strategy::kFp8;
          }
        }
        sum.bytes += y.bytes;
        rerun_cap += y.bytes;
        if (offload) {
          sum.offloadable += y.bytes;
          sum.d2h_rate = std::min(sum.d2h_rate, y.d2h_s / y.bytes);
          sum.h2d_rate = std::min(sum.h2d_rate, y.h2d_s / y.bytes);
        }
        if (fp8 && y.bytes > y.fp8_bytes) {
          out.items.push_back({y.fp8_s / (y.bytes - y.fp8_bytes), y.bytes - y.fp8_bytes, producer});
        }
      }
      // A dropped tensor from outside adds nothing; one of the chunk's reruns its producer.
      const double rerun_s = producer < 0 ? 0.0 : ops_[static_cast<size_t>(producer)].forward_s;
      if (rerun_cap > 0) out.items.push_back({rerun_s / rerun_cap, rerun_cap, producer});
      if (c >= 1) out.cuts[c] = sum;
    }
    return out;
  }

  // A lower bound of what the operators before cut c (their items in `k`, their cuts in
  // `shedding`) add to the exposed overhead of a label whose terms (with fixed_[c]) are `least`,
  // within `mem_limit`; infinity where even the relaxation cannot fit.
  double Extra(size_t c, const Shedding& shedding, const Knapsack& k, const Terms& least,
               double mem_limit) const {
    if (c == 0) return 0;
    const Cut& at = shedding.cuts[c];
    double need = at.bytes - (mem_limit - least.mem);
    if (need <= 0) return 0;
    if (!(at.offloadable > 0)) return k.Fill(need);
    // Offloads hidden under the windows' slack are free; past it an offloaded byte exposes at
    // least the cheaper copy rate: one more item, `beyond`, of all the offloadable bytes.
    const double free_d2h = std::max(0.0, forward_s_ - least.d2h) / at.d2h_rate;
    const double free_h2d = std::max(0.0, backward_s_ - least.h2d) / at.h2d_rate;
    need -= std::min({free_d2h, free_h2d, at.offloadable});
    if (need <= 0) return 0;
    const double rate = std::min(at.d2h_rate, at.h2d_rate), cap = at.offloadable;
    const auto [below_cap, below_cost] = k.Below(rate);
    if (need <= below_cap) return k.Fill(need);
    if (need <= below_cap + cap) return below_cost + (need - below_cap) * rate;
    return k.Fill(need - cap) + cap * rate;
  }

  struct TensorCost {
    double bytes = 0, fp8_bytes = 0, fp8_s = 0, d2h_s = 0, h2d_s = 0, copy_host_s = 0;
    bool skip = false;  // a block input: always on device, whatever its savers do
    bool saved = false;
    bool always_retained = false;
  };
  struct OpInfo {
    double forward_s = 0;
    std::vector<Strategy> choices;
    std::vector<int> saves;    // saved tensors that strategies move
    std::vector<int> inputs;   // inputs a rerun must regenerate unless retained
    std::vector<int> outputs;  // tensors it produces (placement final once it is decided)
  };

  double Overhead(const Terms& t) const {
    return t.local + std::max(0.0, t.d2h - forward_s_) + std::max(0.0, t.h2d - backward_s_);
  }
  // Adds the placement of tensor t with saver code `m` (1 keep, 2 offload, 3 FP8).
  void Place(int t, uint8_t m, Terms& terms) const {
    const TensorCost& y = tensors_[t];
    if (m == 1) {
      terms.mem += y.bytes;
    } else if (m == 2) {
      terms.d2h += y.d2h_s;
      terms.h2d += y.h2d_s;
      terms.local += y.copy_host_s;
      terms.host += y.bytes;
    } else if (m == 3) {
      terms.mem += y.fp8_bytes;
      terms.local += y.fp8_s;
    }
  }

  static void Add(const Terms& a, Terms& to) {
    to.mem += a.mem;
    to.local += a.local;
    to.d2h += a.d2h;
    to.h2d += a.h2d;
    to.host += a.host;
  }

  const StageGraph& g_;
  std::vector<char> fixed_tensor_;  // its savers all pinned: in fixed_
  std::vector<TensorCost> tensors_;
  std::vector<Terms> fixed_;
  std::vector<OpInfo> ops_;
  std::vector<int> externals_;
  std::vector<std::vector<int>> open_;
  size_t max_open_ = 0;
  double forward_s_ = 0, backward_s_ = 0;
};

// Buffers Reduce reuses from one cut to the next.
struct Scratch {
  std::vector<Label> kept;
  std::vector<double> local, d2h, h2d, host;  // the kept labels of one signature
  std::vector<char> keep;
};

// Keeps, per signature, the labels no other label of that signature dominates. Past `cap`
// labels in all, each signature's labels are thinned on a grid of bytes and D2H seconds: each
// cell keeps its cheapest label and its least-bytes one. Returns false when it thinned.
bool Reduce(std::vector<Label>& labels, const Problem& p, double mem_limit, bool with_host,
            size_t cap, Scratch& scratch) {
  std::sort(labels.begin(), labels.end(), [](const Label& a, const Label& b) {
    if (a.sig != b.sig) return a.sig < b.sig;
    if (a.terms.mem != b.terms.mem) return a.terms.mem < b.terms.mem;
    if (a.terms.local != b.terms.local) return a.terms.local < b.terms.local;
    if (a.terms.d2h != b.terms.d2h) return a.terms.d2h < b.terms.d2h;
    return a.terms.h2d < b.terms.h2d;
  });
  constexpr size_t kExactGroup = 2048;
  std::vector<Label>& kept = scratch.kept;
  kept.clear();
  kept.reserve(labels.size());
  bool exact = true;
  const bool no_host = !with_host;
  for (size_t i = 0; i < labels.size();) {
    size_t j = i;
    while (j < labels.size() && labels[j].sig == labels[i].sig) ++j;
    if (j - i <= kExactGroup) {
      // The kept labels' terms side by side, ordered by recompute seconds: only those at or
      // below the label's can dominate it, and the labels come in order of bytes, so every kept
      // one has no more bytes than it (the same answer as comparing it with each kept label).
      // Along a front, a label with more bytes mostly has fewer seconds: few to compare.
      scratch.local.clear();
      scratch.d2h.clear();
      scratch.h2d.clear();
      scratch.host.clear();
      for (size_t k = i; k < j; ++k) {
        const Label& label = labels[k];
        const Terms& t = label.terms;
        const size_t below = static_cast<size_t>(
            std::upper_bound(scratch.local.begin(), scratch.local.end(), t.local) -
            scratch.local.begin());
        const double* kd = scratch.d2h.data();
        const double* kh = scratch.h2d.data();
        const double* kx = scratch.host.data();
        bool dominated = false;
        for (size_t q = 0; q < below && !dominated; ++q) {
          dominated = kd[q] <= t.d2h && kh[q] <= t.h2d && (no_host || kx[q] <= t.host);
        }
        if (dominated) continue;
        kept.push_back(label);
        const auto at = static_cast<long>(below);
        scratch.local.insert(scratch.local.begin() + at, t.local);
        scratch.d2h.insert(scratch.d2h.begin() + at, t.d2h);
        scratch.h2d.insert(scratch.h2d.begin() + at, t.h2d);
        scratch.host.insert(scratch.host.begin() + at, t.host);
      }
    } else {
      exact = false;
      kept.insert(kept.end(), labels.begin() + static_cast<long>(i),
                  labels.begin() + static_cast<long>(j));
    }
    i = j;
  }
  labels.swap(kept);
  if (labels.size() <= cap) return exact;
  // Thin on a grid, coarser until the labels fit.
  const double dm = std::max(mem_limit, 1.0);
  const double dd = std::max(p.forward_s_, 1e-9);
  // Small caps (the anytime path's first answer) start coarser: a grid of 64 cells would keep
  // most of a few dozen labels and only cost passes. From a cap of 128 up the grid starts at 64.
  int first_cells = 1;
  while (first_cells < 64 && 2 * first_cells <= static_cast<int>(cap / 2)) first_cells *= 2;
  for (int cells = first_cells; labels.size() > cap && cells >= 1; cells /= 2) {
    struct Cell {
      uint64_t sig;
      int64_t m, d;
      double cost;
      int index;
    };
    std::vector<Cell> order(labels.size());
    for (size_t i = 0; i < labels.size(); ++i) {
      const Terms& t = labels[i].terms;
      order[i] = {labels[i].sig, static_cast<int64_t>(t.mem / dm * cells),
                  static_cast<int64_t>(std::min(t.d2h / dd, 4.0) * cells), p.Overhead(t),
                  static_cast<int>(i)};
    }
    const auto before = [](const Cell& a, const Cell& b) {
      if (a.sig != b.sig) return a.sig < b.sig;
      if (a.m != b.m) return a.m < b.m;
      if (a.d != b.d) return a.d < b.d;
      return a.cost < b.cost || (a.cost == b.cost && a.index < b.index);
    };
    // The labels come sorted by signature and bytes, so their cells (signature, bytes column)
    // already ascend: sorting within each column gives the order of the full sort (the index
    // makes the order total). Otherwise the full sort.
    bool columns_ascend = true;
    for (size_t i = 1; i < order.size() && columns_ascend; ++i) {
      columns_ascend = order[i - 1].sig < order[i].sig ||
                       (order[i - 1].sig == order[i].sig && order[i - 1].m <= order[i].m);
    }
    if (columns_ascend) {
      for (size_t i = 0; i < order.size();) {
        size_t j = i + 1;
        while (j < order.size() && order[j].sig == order[i].sig && order[j].m == order[i].m) ++j;
        if (j - i > 1) {
          std::sort(order.begin() + static_cast<long>(i), order.begin() + static_cast<long>(j),
                    before);
        }
        i = j;
      }
    } else {
      std::sort(order.begin(), order.end(), before);
    }
    std::vector<char>& keep = scratch.keep;
    keep.assign(labels.size(), 0);
    for (size_t i = 0; i < order.size();) {
      size_t j = i;
      int least = order[i].index;
      while (j < order.size() && order[j].sig == order[i].sig && order[j].m == order[i].m &&
             order[j].d == order[i].d) {
        if (labels[order[j].index].terms.mem < labels[least].terms.mem) least = order[j].index;
        ++j;
      }
      keep[order[i].index] = 1;  // the cheapest of the cell
      keep[least] = 1;           // and its least bytes
      i = j;
    }
    size_t w = 0;
    for (size_t i = 0; i < labels.size(); ++i) {
      if (keep[i]) labels[w++] = labels[i];
    }
    labels.resize(w);
  }
  if (labels.size() > cap) {
    // Still too many signatures: the cheapest stay, and the least bytes.
    std::vector<size_t> idx(labels.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
      return p.Overhead(labels[a].terms) < p.Overhead(labels[b].terms);
    });
    size_t least = 0;
    for (size_t i = 1; i < labels.size(); ++i) {
      if (labels[i].terms.mem < labels[least].terms.mem) least = i;
    }
    std::vector<char> keep(labels.size(), 0);
    keep[least] = 1;
    for (size_t i = 0; i + 1 < cap && i < idx.size(); ++i) keep[idx[i]] = 1;
    size_t w = 0;
    for (size_t i = 0; i < labels.size(); ++i) {
      if (keep[i]) labels[w++] = labels[i];
    }
    labels.resize(w);
  }
  return false;
}

}  // namespace

std::optional<OperatorDpResult> OperatorDp(const CostEvaluator& eval, double r, double budget,
                                           double bound, const MitigationOptions& options,
                                           int max_states, const Pinned* pinned) {
  const StageGraph& g = eval.graph();
  const size_t n = g.ops.size();
  if (n == 0) return std::nullopt;
  if (pinned != nullptr && (pinned->pinned.size() != n || pinned->strategies.size() != n)) {
    return std::nullopt;
  }
  const Problem p(eval, r, options, pinned);
  if (p.max_open_ > static_cast<size_t>(kMaxSlots)) return std::nullopt;
  const double mem_limit = budget - g.M0(r);
  const double slack = 1e-9 * std::max(1.0, budget);
  const bool with_host = options.host_limit_bytes >= 0;
  const double host_limit =
      options.host_limit_bytes + 1e-9 * std::max(1.0, options.host_limit_bytes);
  const size_t cap =
      static_cast<size_t>(std::max(4, max_states > 0 ? max_states : options.dp_states));
  const Deadline* deadline = eval.deadline();

  std::vector<std::vector<Label>> cuts(n + 1);
  cuts[n].push_back({});
  Scratch scratch;
  // built where a front first passes its cap
  std::optional<Problem::Shedding> shedding;
  std::optional<Knapsack> knapsack;
  // One choice's move from a signature (see below).
  struct Move {
    bool conflict = false, rerun = false;
    uint64_t sig = 0;
    size_t begin = 0, middle = 0, end = 0;  // its placements: outputs, then tensors from outside
  };
  struct Placement {
    int tensor;
    uint8_t code;
  };
  std::vector<Move> moves;
  std::vector<Placement> places;
  std::vector<uint8_t> val(g.tensors.size(), 0);
  OperatorDpResult result;
  result.exact = true;
  for (size_t o = n; o-- > 0;) {
    const Problem::OpInfo& op = p.ops_[o];
    const std::vector<int>& before = p.open_[o + 1];
    const std::vector<int>& after = p.open_[o];
    std::vector<Label>& next = cuts[o];
    const std::vector<Label>& prev = cuts[o + 1];
    if (knapsack) knapsack->RemoveProducer(static_cast<int>(o));  // placed at cut o
    next.reserve(prev.size() * op.choices.size());
    // A choice changes only the codes of the operator's saves and inputs, and what it adds depends
    // only on the label's signature: for each run of labels of one signature (the front comes
    // sorted by signature) the signature is decoded once and each choice's move is worked out
    // once (its conflict, its placements in order, its rerun, the signature it leads to); each
    // label then adds those placements to its own terms in the same order as before.
    std::vector<uint8_t> touched(op.saves.size() + op.inputs.size());
    const size_t nc = op.choices.size();
    moves.resize(nc);
    for (size_t s = 0; s < prev.size(); ++s) {
      if (deadline != nullptr) deadline->Check();
      const Label& from = prev[s];
      if (s == 0 || from.sig != prev[s - 1].sig) {
        for (int t : after) val[t] = 0;
        for (int t : op.outputs) val[t] = 0;
        for (int t : op.saves) val[t] = 0;
        for (size_t i = 0; i < before.size(); ++i) {
          val[before[i]] = static_cast<uint8_t>((from.sig >> (kSlotBits * i)) & 7u);
        }
        for (size_t i = 0; i < op.saves.size(); ++i) touched[i] = val[op.saves[i]];
        for (size_t i = 0; i < op.inputs.size(); ++i) {
          touched[op.saves.size() + i] = val[op.inputs[i]];
        }
        places.clear();
        for (size_t c = 0; c < nc; ++c) {
          Move& move = moves[c];
          // Every snapshot was taken from the same decoded state, so the order does not matter.
          for (size_t i = 0; i < op.saves.size(); ++i) val[op.saves[i]] = touched[i];
          for (size_t i = 0; i < op.inputs.size(); ++i) {
            val[op.inputs[i]] = touched[op.saves.size() + i];
          }
          move.conflict = false;
          const uint8_t code = Code(op.choices[c]);
          if (code != 0) {
            for (int t : op.saves) {
              const uint8_t m = val[t] & 3u;
              if (m == 0) {
                val[t] |= code;
              } else if (m != code) {
                move.conflict = true;
                break;
              }
            }
          }
          if (move.conflict) continue;
          move.begin = places.size();
          move.rerun = false;
          for (int t : op.outputs) {
            const uint8_t m = val[t] & 3u;
            if (p.tensors_[t].saved) {
              places.push_back({t, m});
              if (m == 0) move.rerun = true;  // dropped: every saver recomputes
            } else if (val[t] & kNeeded) {
              move.rerun = true;  // unsaved, read by an operator that reruns
            }
          }
          if (move.rerun) {
            for (int u : op.inputs) val[u] |= kNeeded;
          }
          move.middle = places.size();
          if (o == 0) {
            for (int t : p.externals_) places.push_back({t, static_cast<uint8_t>(val[t] & 3u)});
          }
          move.end = places.size();
          uint64_t sig = 0;
          for (size_t i = 0; i < after.size(); ++i) {
            sig |= static_cast<uint64_t>(val[after[i]]) << (kSlotBits * i);
          }
          move.sig = sig;
        }
      }
      for (size_t c = 0; c < nc; ++c) {
        const Move& move = moves[c];
        if (move.conflict) continue;
        Label x;
        x.terms = from.terms;
        for (size_t i = move.begin; i < move.middle; ++i) {
          p.Place(places[i].tensor, places[i].code, x.terms);
        }
        if (move.rerun) x.terms.local += op.forward_s;
        for (size_t i = move.middle; i < move.end; ++i) {
          p.Place(places[i].tensor, places[i].code, x.terms);
        }
        Terms least = x.terms;  // with what the operators before o add for certain
        Problem::Add(p.fixed_[o], least);
        if (least.mem > mem_limit + slack || (with_host && least.host > host_limit) ||
            p.Overhead(least) >= bound) {
          continue;
        }
        x.sig = move.sig;
        x.parent = static_cast<int>(s);
        x.strategy = op.choices[c];
        next.push_back(x);
      }
    }
    // A front past its cap loses, before it is thinned, the labels that cannot reach the bound
    // with what the operators before o must still shed to fit (issue 43: the thinning dropped the
    // optimum's label where labels that could not beat the best plan crowded the front).
    if (next.size() > cap && std::isfinite(bound)) {
      if (!knapsack) {
        shedding = p.MakeShedding();
        knapsack.emplace(shedding->items, static_cast<int>(o));
      }
      size_t w = 0;
      for (const Label& x : next) {
        Terms least = x.terms;
        Problem::Add(p.fixed_[o], least);
        if (p.Overhead(least) +
                (1 - 1e-9) * p.Extra(o, *shedding, *knapsack, least, mem_limit + slack) <
            bound) {
          next[w++] = x;
        }
      }
      next.resize(w);
    }
    result.states += static_cast<int>(next.size());
    if (next.empty()) return std::nullopt;
    if (!Reduce(next, p, mem_limit, with_host, cap, scratch)) result.exact = false;
  }
  // The cheapest final labels first; the first the full evaluator confirms wins (the sums above
  // add in another order, so a label at the budget is checked again).
  const std::vector<Label>& last = cuts[0];
  std::vector<int> order(last.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return p.Overhead(last[a].terms) < p.Overhead(last[b].terms);
  });
  constexpr size_t kChecked = 8;
  for (size_t i = 0; i < order.size() && i < kChecked; ++i) {
    Assignment a(n, Strategy::kKeep);
    int s = order[i];
    for (size_t o = 0; o < n; ++o) {
      const Label& l = cuts[o][s];
      a[o] = l.strategy;
      s = l.parent;
    }
    const AssignmentCost c = eval.Evaluate(a, r);
    if (!c.conflict && c.device_bytes <= budget && options.HostFits(c.host_bytes)) {
      result.assignment = std::move(a);
      return result;
    }
  }
  return std::nullopt;
}

}  // namespace bgl::plan
