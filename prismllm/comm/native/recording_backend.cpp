// RecordingBackend: a c10d::Backend that records every call and forwards it to the real
// backend (ProcessGroupNCCL / ProcessGroupGloo) it wraps. The recording path of `prism record`
// without Python on the hot path: torch's ProcessGroup dispatches to this class exactly as it
// would to the real backend, and each call costs a few appends and, on CUDA, event records.
//
// What is recorded is a log of the points of the rank's program order (issue of a call, the
// return of the backend call, the program's wait on a Work, boundaries, backward ends) with
// host times and, on CUDA, an event recorded on the current stream; plus one row per tensor
// call. Python turns the log into RankLog nodes once, at exit (prismllm/comm/native/replay.py,
// through the same Recorder logic the Python recording path uses live), so the rules of the
// node model live in one place.
// pybind11 with torch's casters, not <torch/extension.h>: the whole of torch's C++ API made
// the one build a fresh machine pays 39 s instead of 25 s (2-core dev VM, torch 2.13).
#include <torch/csrc/utils/pybind.h>

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <map>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace prism {

using c10d::Backend;
using c10d::Work;
using c10::intrusive_ptr;

static inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

static inline int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Entry types of the log (prismllm/comm/native/replay.py reads them by these numbers).
enum EntryType : int8_t {
  E_START = 0,     // p0
  E_CALL = 1,      // a: first row, b: rows, c: work id (-1 none), flag: bit0 sync, bit1 first
                   //   call of a backward pass; p0 issue, p1 return, p2 completion (no Work)
  E_WAIT = 2,      // c: work id, p0 before, p1 after, b: source rank of an any-source recv
  E_COAL_BEGIN = 3,  // flag: -1 keep, 0/1 set the scope's async_ops
  E_COAL_END = 4,    // ends the innermost E_COAL_BEGIN (restores its async_ops if it set them)
  E_BATCH = 5,     // end of a backend coalescing scope: c: work id (-1 none), p2 completion
  E_BWD_END = 6,   // p0
  E_BOUNDARY = 7,  // flag: explicit; p0
  E_MARK = 8,      // a: label id; p0: the point where the labelled span starts
  E_FINISH = 9,    // p0
  E_COAL_START = 10,  // the backend's own startCoalescing (a nested scope)
};

struct Entry {
  int8_t type;
  int8_t flag;
  int32_t a, b, c;
  int64_t p0, p1, p2;
};

// A row's reduction: the ReduceOp's code (-1: none) and a PREMUL_SUM's factor (NaN otherwise).
// A tensor factor is read on the host (a device sync, where the program passed a device tensor).
struct Red {
  int8_t code = -1;
  double factor = std::nan("");
  Red(int c) : code(static_cast<int8_t>(c)) {}
  Red(const c10d::ReduceOp& op) : code(static_cast<int8_t>(op.op_)) {
    if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return;
    auto* s = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
    if (s) factor = s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
  }
};

// One row per tensor (pair) of a call.
struct Row {
  int16_t op, api;
  int8_t red, dtype, cuda;
  double factor;  // a PREMUL_SUM's factor (NaN for every other row): the emulation replays it
  int32_t gid, peer, tag;
  int64_t inb, outb;
  int32_t shape0, shape_n, insp0, insp_n, outsp0, outsp_n;
};

struct WorkState {
  int32_t row0 = 0, nrows = 0;
  std::atomic<int64_t> done{-1};  // host completion (Future callback, gloo's thread)
  int64_t dur_ns = -2;            // NCCL's duration: -2 not read, -1 none, -3 timing off
};

static const char* kOps[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                             "broadcast",  "reduce",     "gather",         "scatter",
                             "barrier",    "send",       "recv"};
enum Op : int16_t { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, REDUCE,
                    GATHER, SCATTER, BARRIER, SEND, RECV };
static const char* kApis[] = {"allreduce", "allreduce_coalesced", "allgather",
                              "_allgather_base", "allgather_coalesced",
                              "allgather_into_tensor_coalesced", "reduce_scatter",
                              "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                              "alltoall", "alltoall_base", "broadcast", "reduce", "gather",
                              "scatter", "barrier", "monitored_barrier", "send", "recv",
                              "recv_anysource"};
enum Api : int16_t { A_ALLREDUCE, A_ALLREDUCE_COAL, A_ALLGATHER, A_AG_BASE, A_AG_COAL,
                     A_AG_INTO_COAL, A_RS, A_RS_BASE, A_RS_COAL, A_ALLTOALL, A_A2A_BASE,
                     A_BROADCAST, A_REDUCE, A_GATHER, A_SCATTER, A_BARRIER, A_MON_BARRIER,
                     A_SEND, A_RECV, A_RECV_ANY };

class Log {
 public:
  // ---- points ------------------------------------------------------------------------
  // A point: host time, and on CUDA an event on the current stream (resolved later); with
  // all_points_on_device_ off (prism emulate), the event only at an iteration boundary.
  int64_t point(bool device, bool boundary = false) {
    int64_t pid = static_cast<int64_t>(p_host_.size());
    p_host_.push_back(host_ns());
    int32_t dev = -1, slot = -1;
    if (device && (boundary || all_points_on_device_) && cuda_live()) {
      auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      dev = impl->getDevice().index();
      slot = take_event(dev);
      events_[slot]->record(impl->getStream(c10::Device(c10::DeviceType::CUDA, dev)));
      unresolved_.push_back(pid);
    }
    p_dev_.push_back(dev);
    p_slot_.push_back(slot);
    p_ns_.push_back(slot < 0 ? p_host_.back() : -1);
    return pid;
  }

  bool cuda_live() {
    if (cuda_live_ || !cuda_) return cuda_live_;
    auto& hooks = at::detail::getCUDAHooks();
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    if (!hooks.hasPrimaryContext(impl->getDevice().index())) return false;
    cuda_live_ = true;
    return true;
  }

  // ---- entries -----------------------------------------------------------------------
  void add(int8_t type, int8_t flag = 0, int32_t a = 0, int32_t b = 0, int32_t c = -1,
           int64_t p0 = -1, int64_t p1 = -1, int64_t p2 = -1) {
    entries_.push_back(Entry{type, flag, a, b, c, p0, p1, p2});
  }

  int32_t add_row(int16_t op, int16_t api, Red red, const at::Tensor* t, int32_t gid,
                  int32_t peer, int32_t tag, int64_t inb, int64_t outb, bool cuda,
                  const std::vector<int64_t>* insp = nullptr,
                  const std::vector<int64_t>* outsp = nullptr) {
    Row r{};
    r.op = op; r.api = api; r.red = red.code; r.factor = red.factor; r.cuda = cuda ? 1 : 0;
    r.gid = gid; r.peer = peer; r.tag = tag; r.inb = inb; r.outb = outb;
    r.dtype = t ? static_cast<int8_t>(t->scalar_type()) : -1;
    r.shape0 = static_cast<int32_t>(ints_.size());
    if (t) {
      for (auto d : t->sizes()) ints_.push_back(d);
      r.shape_n = static_cast<int32_t>(t->dim());
    }
    r.insp0 = static_cast<int32_t>(ints_.size());
    if (insp) { ints_.insert(ints_.end(), insp->begin(), insp->end()); r.insp_n = insp->size(); }
    r.outsp0 = static_cast<int32_t>(ints_.size());
    if (outsp) { ints_.insert(ints_.end(), outsp->begin(), outsp->end()); r.outsp_n = outsp->size(); }
    rows_.push_back(r);
    return static_cast<int32_t>(rows_.size() - 1);
  }

  // Undo the rows added since mark_rows() (the backend call raised).
  size_t mark_rows() const { return rows_.size(); }
  void drop_rows(size_t mark) {
    if (mark < rows_.size()) {
      ints_.resize(rows_[mark].shape0);
      rows_.resize(mark);
    }
  }

  // The first call issued during a backward pass queues a callback at its end (settles the
  // Works that pass issued and nobody waits on from Python, e.g. DDP's buckets). That callback
  // queues the settling once more: DDP queues its wait on every bucket at its last bucket, after
  // this one, and the settling's point must be where the stream stands after that wait
  // (Recorder._on_backward_end).
  bool check_backward() {
    if (bwd_queued_ || torch::autograd::get_current_graph_task_id() == -1) return false;
    try {
      torch::autograd::Engine::get_default_engine().queue_callback([this]() {
        torch::autograd::Engine::get_default_engine().queue_callback([this]() {
          std::lock_guard<std::mutex> g(mu);
          bwd_queued_ = false;
          add(E_BWD_END, 0, 0, 0, -1, point(true));
        });
      });
    } catch (...) {
      return false;
    }
    bwd_queued_ = true;
    return true;
  }

  int32_t new_work(int32_t row0, int32_t nrows) {
    works_.emplace_back();
    works_.back().row0 = row0;
    works_.back().nrows = nrows;
    return static_cast<int32_t>(works_.size() - 1);
  }

  // The host clock of the rank's points: the wall clock less the host time the emulation's
  // native lane left out on gloo (``exclude``), as the Python recorder's clock leaves out its
  // pruned backend's own work where the host clock is the device clock (docs/commands/time.md).
  int64_t host_ns() const { return wall_ns() - excluded_.load(std::memory_order_relaxed); }
  void exclude(int64_t ns) {
    int64_t all = excluded_.fetch_add(ns, std::memory_order_relaxed) + ns;
    // the CPU emulation's board (prismllm/comm/leftout.py): the assistant's clock leaves it out too
    if (left_out_board_ != nullptr) reinterpret_cast<std::atomic<int64_t>*>(left_out_board_)->store(all);
  }
  int64_t excluded_ns() const { return excluded_.load(std::memory_order_relaxed); }
  void set_left_out_board(int64_t address) { left_out_board_ = reinterpret_cast<int64_t*>(address); }

  // NCCL's device duration of async Works, read by the resolver once they complete (so a
  // Work -- and its tensors -- is held only until shortly after it completes, as NCCL's own
  // watchdog holds it).
  void watch_duration(int32_t wid, const intrusive_ptr<Work>& w) {
    if (durations_ok_) dur_q_.emplace_back(wid, w);
  }

  // Host completion of an async CPU call: stamped on the backend's thread by a Future
  // callback (exact to the thread's wake-up; the wait's return would add the program's time
  // elsewhere).
  void watch_future(int32_t wid, const intrusive_ptr<Work>& w) {
    std::atomic<int64_t>* slot = &works_[wid].done;  // deque: the address stays valid
    try {
      w->getFuture()->addCallback([this, slot](c10::ivalue::Future&) { slot->store(host_ns()); });
    } catch (...) {
    }
  }

  // ---- CUDA events ---------------------------------------------------------------------
  int32_t take_event(int32_t dev) {
    auto& pool = pool_[dev];
    if (pool.empty()) {
      if (!anchored_[dev]) anchor(dev);
      if (pool.empty()) {
        events_.push_back(std::make_unique<c10::Event>(
            c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT));
        return static_cast<int32_t>(events_.size() - 1);
      }
    }
    int32_t s = pool.back();
    pool.pop_back();
    return s;
  }

  // The device's first point: a reference event whose host time is known (taken right after
  // it completed). Later events are resolved against the previous resolved event of their
  // device and add integer nanoseconds, so a long run keeps CUDA's event resolution (a single
  // reference would lose precision to elapsed_time's 32-bit float in ms: ~8 µs at 100 s).
  void anchor(int32_t dev) {
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device d(c10::DeviceType::CUDA, dev);
    auto stream = impl->getStream(d);
    for (int i = 0; i < 1024; ++i) {  // the first iterations' events, made off the hot path
      events_.push_back(std::make_unique<c10::Event>(
          c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT));
      events_.back()->record(stream);
      pool_[dev].push_back(static_cast<int32_t>(events_.size() - 1));
    }
    impl->synchronizeDevice(dev);
    events_.push_back(std::make_unique<c10::Event>(
        c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT));
    int32_t a = static_cast<int32_t>(events_.size() - 1);
    events_[a]->record(stream);
    events_[a]->synchronize();
    last_ev_[dev] = a;
    last_ns_[dev] = wall_ns();
    anchored_[dev] = true;
    if (!resolver_.joinable()) start_resolver(dev);
  }

  // NCCL's device duration of a completed Work in ns (-1: none); throws when timing is off.
  static int64_t duration_ns(Work& w) {
    float ms = w.getDuration();
    return ms > 0 ? static_cast<int64_t>(ms * 1e6 + 0.5) : -1;
  }

  // ---- the resolver: device times off the program's thread ----------------------------
  // Resolving a point (query its event, time it against the previous one) and reading NCCL's
  // durations cost the host ~3-4 us each (measured on nvidia-h100-x1: 1.1-1.7 ms per
  // iteration boundary of 100 calls when the program's thread did it). A thread does it
  // instead, every kResolveEvery or when a boundary wakes it, without holding the log's lock
  // during the CUDA calls.
  static constexpr std::chrono::milliseconds kResolveEvery{2};

  void start_resolver(int32_t dev) {
    resolver_ = std::thread([this, dev] {
      // this thread's current device: the program's, so that the device guards of the
      // CUDA calls below never touch (and create a context on) another GPU
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
          ->setDevice(c10::Device(c10::DeviceType::CUDA, dev));
      std::unique_lock<std::mutex> lk(mu);
      while (!stop_) {
        cv_.wait_for(lk, kResolveEvery);
        if (stop_) break;
        try {
          resolve_some(lk);
        } catch (...) {  // e.g. the CUDA runtime going away at exit: finish() resolves the rest
          break;
        }
      }
    });
  }

  // Resolve the oldest pending points whose events are complete (stopping at the first that
  // is not) and read the durations of the completed Works. Called with `lk` held; releases it
  // around the CUDA calls.
  void resolve_some(std::unique_lock<std::mutex>& lk) {
    struct Pending { int64_t pid; int32_t slot, dev; c10::Event* ev; };
    std::vector<Pending> batch;
    batch.reserve(std::min<size_t>(unresolved_.size(), 8192));
    for (int64_t pid : unresolved_) {
      int32_t slot = p_slot_[pid];
      batch.push_back({pid, slot, p_dev_[pid], events_[slot].get()});
      if (batch.size() == 8192) break;
    }
    auto chain_ev = last_ev_;
    auto chain_ns = last_ns_;
    std::unordered_map<int32_t, c10::Event*> chain;
    for (auto& [dev, slot] : chain_ev) chain[dev] = events_[slot].get();
    std::vector<std::pair<int32_t, intrusive_ptr<Work>>> durs(
        std::make_move_iterator(dur_q_.begin()), std::make_move_iterator(dur_q_.end()));
    dur_q_.clear();
    lk.unlock();

    std::vector<int64_t> ns_of;      // device times of batch[0 .. ns_of.size())
    std::vector<std::pair<int32_t, int32_t>> freed;  // (device, event slot) back to the pool
    for (auto& p : batch) {
      if (!p.ev->query()) break;
      double ms = chain[p.dev]->elapsedTime(*p.ev);
      int64_t ns = chain_ns[p.dev] + static_cast<int64_t>(ms * 1e6 + (ms >= 0 ? 0.5 : -0.5));
      ns_of.push_back(ns);
      freed.emplace_back(p.dev, chain_ev[p.dev]);
      chain_ev[p.dev] = p.slot;
      chain[p.dev] = p.ev;
      chain_ns[p.dev] = ns;
    }
    // Every completed Work, not only those ahead of the first incomplete one: a Work holds its
    // tensors (NCCL's outputs), and one queued behind a call of another stream that completes
    // late (a prefetch the program waits on much later) would keep them from the allocator.
    std::vector<std::pair<int32_t, int64_t>> dur_ns;  // (work id, duration)
    std::vector<std::pair<int32_t, intrusive_ptr<Work>>> left;
    bool timing_off = false;
    for (auto& [wid, w] : durs) {
      if (timing_off) {
        dur_ns.emplace_back(wid, -3);
      } else if (!w->isCompleted()) {
        left.emplace_back(wid, std::move(w));
      } else {
        try {
          dur_ns.emplace_back(wid, duration_ns(*w));
        } catch (...) {
          timing_off = true;
          dur_ns.emplace_back(wid, -3);
        }
      }
    }
    if (timing_off) {
      for (auto& [wid, w] : left) dur_ns.emplace_back(wid, -3);
      left.clear();
    }
    durs.clear();  // the completed Works go here, outside the lock

    lk.lock();
    for (size_t i = 0; i < ns_of.size(); ++i) {
      p_ns_[batch[i].pid] = ns_of[i];
      unresolved_.pop_front();
    }
    for (auto& [dev, slot] : freed) pool_[dev].push_back(slot);
    for (auto& [dev, slot] : chain_ev) {
      last_ev_[dev] = slot;
      last_ns_[dev] = chain_ns[dev];
    }
    for (auto& [wid, d] : dur_ns) works_[wid].dur_ns = d;
    if (timing_off) {
      durations_ok_ = false;
      for (auto& [wid, w] : dur_q_) works_[wid].dur_ns = -3;
      dur_q_.clear();
    } else {  // the Works not yet complete stay ahead of those queued meanwhile
      dur_q_.insert(dur_q_.begin(), std::make_move_iterator(left.begin()),
                    std::make_move_iterator(left.end()));
    }
  }

  void boundary(bool explicit_) {
    int64_t t0 = steady_ns();
    std::lock_guard<std::mutex> g(mu);
    last_sync_ = -1;
    add(E_BOUNDARY, explicit_ ? 1 : 0, 0, 0, -1, point(true, true));
    if (cuda_live_) cv_.notify_one();
    ++self.boundaries;
    self.boundary_ns += steady_ns() - t0;
  }

  // A Work the program let go of while the real backend's worker thread still held it (gloo
  // drops its own reference only after completing it). Had that worker's drop been the last,
  // and come after the interpreter began to finalize, freeing the Work's tensors would need the
  // GIL, which a finalizing interpreter denies by ending the thread: the process aborted
  // ("terminate called without an active exception", about one run in four of a two-rank
  // program on a 2-core machine). So such a Work is kept here, and freed by a later call or at
  // finish() once its worker let go -- CPU runs only: on a GPU, holding a Work would hold device
  // memory past the program's release, which the measured peak must not see.
  void bury(intrusive_ptr<Work> w) {
    std::lock_guard<std::mutex> g(grave_mu_);
    grave_.push_back(std::move(w));
  }

  // Free the buried Works no worker holds any more; with ``wait``, wait (up to 2 s) for every
  // one. The caller holds neither lock nor the GIL: a Work's destructor may take the GIL.
  void free_buried(bool wait) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    std::vector<intrusive_ptr<Work>> done;
    for (;;) {
      bool again;
      {
        std::lock_guard<std::mutex> g(grave_mu_);
        if (grave_.empty()) return;
        auto held = std::partition(grave_.begin(), grave_.end(),
                                   [](const intrusive_ptr<Work>& w) { return w.use_count() > 1; });
        done.insert(done.end(), std::make_move_iterator(held), std::make_move_iterator(grave_.end()));
        grave_.erase(held, grave_.end());
        again = wait && !grave_.empty() && std::chrono::steady_clock::now() < deadline;
      }
      done.clear();
      if (!again) return;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  void finish() {
    std::unique_lock<std::mutex> lk(mu);
    add(E_FINISH, 0, 0, 0, -1, point(true, true));
    lk.unlock();
    free_buried(true);
    lk.lock();
    if (!cuda_live_) return;
    stop_ = true;
    lk.unlock();
    cv_.notify_all();
    if (resolver_.joinable()) resolver_.join();
    lk.lock();
    for (auto& [dev, ok] : anchored_) {
      if (ok) c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->synchronizeDevice(dev);
    }
    while (!unresolved_.empty()) {  // every event is complete now
      size_t before = unresolved_.size();
      resolve_some(lk);
      if (unresolved_.size() == before) throw std::runtime_error("prism: a CUDA event did not complete");
    }
    resolve_some(lk);  // the durations of Works completed since
    for (auto& [wid, w] : dur_q_) {
      try {
        works_[wid].dur_ns = duration_ns(*w);
      } catch (...) {
        works_[wid].dur_ns = -3;
      }
    }
    dur_q_.clear();
  }

  py::dict export_log() {
    std::lock_guard<std::mutex> g(mu);
    py::dict d;
    std::vector<std::tuple<int, int, int, int, int, int64_t, int64_t, int64_t>> ents;
    ents.reserve(entries_.size());
    for (auto& e : entries_) ents.emplace_back(e.type, e.flag, e.a, e.b, e.c, e.p0, e.p1, e.p2);
    d["entries"] = ents;
    std::vector<std::tuple<int, int, int, py::object, int, int, int, int, int64_t, int64_t>> rows;
    std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>> lists;
    for (auto& r : rows_) {
      py::object dt = r.dtype < 0 ? py::none() : py::cast(static_cast<at::ScalarType>(r.dtype));
      rows.emplace_back(r.op, r.api, r.red, dt, r.cuda, r.gid, r.peer, r.tag, r.inb, r.outb);
      auto sl = [&](int32_t o, int32_t n) {
        return std::vector<int64_t>(ints_.begin() + o, ints_.begin() + o + n);
      };
      lists.emplace_back(sl(r.shape0, r.shape_n), sl(r.insp0, r.insp_n), sl(r.outsp0, r.outsp_n));
    }
    d["rows"] = rows;
    d["lists"] = lists;
    py::dict factors;  // row -> PREMUL_SUM factor
    for (size_t k = 0; k < rows_.size(); ++k)
      if (!std::isnan(rows_[k].factor)) factors[py::int_(k)] = rows_[k].factor;
    d["factors"] = factors;
    std::vector<std::tuple<int64_t, int64_t>> works;
    for (auto& w : works_) works.emplace_back(w.done.load(), w.dur_ns);
    d["works"] = works;
    d["p_host"] = p_host_;
    d["p_ns"] = p_ns_;
    d["p_dev"] = p_dev_;
    d["labels"] = labels_;
    return d;
  }

  // The recorder's own host time (steady clock), kept apart from the real backend's: what
  // recording adds to a call and a wait (`native.self_time()`, benchmarks/programs/call_cost.py).
  struct SelfTime {
    int64_t calls = 0, call_ns = 0, inner_call_ns = 0;
    int64_t waits = 0, wait_ns = 0, inner_wait_ns = 0;
    int64_t boundaries = 0, boundary_ns = 0;
  } self;

  std::mutex mu;  // the program's thread(s): main, and autograd's device threads in backward
  bool cuda_ = false;
  bool all_points_on_device_ = true;
  bool cuda_live_ = false;
  bool bwd_queued_ = false;
  bool durations_ok_ = true;
  int32_t last_sync_ = -1;  // the Work of the last call issued sync, while nothing followed
  int32_t waiting_ = -1;  // the Work the program is waiting on (a status report's answer)
  const Row* row_at(int64_t k) const {
    return (k >= 0 && k < static_cast<int64_t>(rows_.size())) ? &rows_[k] : nullptr;
  }
  int64_t num_rows() const { return static_cast<int64_t>(rows_.size()); }
  int8_t sync_p2p_ = 0;     // set by Python's send/recv: the next P2P call is waited at once
  std::vector<std::string> labels_;
  std::deque<WorkState> works_;

 private:
  std::vector<Entry> entries_;
  std::vector<Row> rows_;
  std::vector<int64_t> ints_;
  std::vector<int64_t> p_host_, p_ns_;
  std::atomic<int64_t> excluded_{0};  // host time left out of the points (host_ns)
  int64_t* left_out_board_ = nullptr;  // where this rank's excluded_ is shared (set_left_out_board)
  std::vector<int32_t> p_dev_, p_slot_;
  std::deque<int64_t> unresolved_;
  std::vector<std::unique_ptr<c10::Event>> events_;
  std::unordered_map<int32_t, std::vector<int32_t>> pool_;
  std::unordered_map<int32_t, bool> anchored_;
  std::unordered_map<int32_t, int32_t> last_ev_;
  std::unordered_map<int32_t, int64_t> last_ns_;
  std::deque<std::pair<int32_t, intrusive_ptr<Work>>> dur_q_;
  std::mutex grave_mu_;  // never held while waiting for anything else
  std::vector<intrusive_ptr<Work>> grave_;
  std::thread resolver_;
  std::condition_variable cv_;
  bool stop_ = false;
};

static Log& the_log() {
  static Log* log = new Log();  // never destroyed: Works may outlive interpreter teardown
  return *log;
}

// ---- the Work the program gets ---------------------------------------------------------------
// A Work that answers for another (``inner_``): every query forwarded; a subclass adds to the waits.
class ForwardingWork : public Work {
 public:
  ForwardingWork(intrusive_ptr<Work> inner, c10d::OpType type) : Work(-1, type), inner_(std::move(inner)) {}
  bool wait(std::chrono::milliseconds timeout) override { return inner_->wait(timeout); }
  void synchronize() override { inner_->synchronize(); }
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    return inner_->getFutureResult();
  }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }
  void abort() override { inner_->abort(); }

 protected:
  intrusive_ptr<Work> inner_;
};

class RecordedWork : public ForwardingWork {
 public:
  RecordedWork(intrusive_ptr<Work> inner, int32_t wid, bool anysource, std::vector<int>* granks)
      : ForwardingWork(inner, inner->retrieveOpType()), wid_(wid), anysource_(anysource), granks_(granks) {}

  ~RecordedWork() override {
    if (inner_ && !the_log().cuda_ && inner_.use_count() > 1) the_log().bury(std::move(inner_));
  }

  bool wait(std::chrono::milliseconds timeout) override {
    int64_t t0 = steady_ns();
    int64_t before = begin_wait();
    int64_t t1 = steady_ns();
    bool r;
    try {
      r = inner_->wait(timeout);
    } catch (...) {
      end_wait(before, t0, t1);
      throw;
    }
    end_wait(before, t0, t1);
    return r;
  }
  void synchronize() override {
    int64_t t0 = steady_ns();
    int64_t before = begin_wait();
    int64_t t1 = steady_ns();
    try {
      inner_->synchronize();
    } catch (...) {
      end_wait(before, t0, t1);
      throw;
    }
    end_wait(before, t0, t1);
  }

 private:
  int64_t begin_wait() {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    if (waited_) return -2;
    log.waiting_ = wid_;
    // A wait right after its own sync issue needs no "before" point (the Python rule).
    int64_t p = log.last_sync_ == wid_ ? -1 : log.point(true);
    log.last_sync_ = -1;
    return p;
  }
  // t0, t1: when the wait began and when the real backend's wait was entered
  void end_wait(int64_t before, int64_t t0, int64_t t1) {
    int64_t t2 = steady_ns();
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    log.self.waits++;
    log.self.inner_wait_ns += t2 - t1;
    if (log.waiting_ == wid_) log.waiting_ = -1;
    if (before == -2) {  // waited before: not a point of program order
      log.self.wait_ns += (t1 - t0) + (steady_ns() - t2);
      return;
    }
    waited_ = true;
    int32_t src = -1;
    if (anysource_) {
      try {
        int s = inner_->sourceRank();
        src = (granks_ && s >= 0 && s < static_cast<int>(granks_->size())) ? (*granks_)[s] : -1;
      } catch (...) {
      }
    }
    log.add(E_WAIT, 0, 0, src, wid_, before, log.point(true));
    log.self.wait_ns += (t1 - t0) + (steady_ns() - t2);
  }

  int32_t wid_;
  bool anysource_;
  bool waited_ = false;
  std::vector<int>* granks_;
};


template <typename T, typename = void>
struct has_async_op : std::false_type {};
template <typename T>
struct has_async_op<T, std::void_t<decltype(std::declval<T>().asyncOp)>> : std::true_type {};

// Whether the program waits on the call at once (the public APIs' async_op=False), where
// this torch says so; otherwise async, as the Python path records it.
template <typename Opts>
static bool is_sync(const Opts& o) {
  if constexpr (has_async_op<Opts>::value) {
    return !o.asyncOp;
  } else {
    return false;
  }
}

// Asks for the call as the program asked for its own (``is_sync``), where this torch has the option:
// since torch 2.8 a ProcessGroupNCCL runs a synchronous call on the caller's current stream and
// returns no Work, where an asynchronous one goes through its own stream, with an event each way.
template <typename Opts>
static void set_sync(Opts& o, bool sync) {
  if constexpr (has_async_op<Opts>::value) o.asyncOp = !sync;
}

#include "pruned_lane.h"

static int64_t nbytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (auto& t : ts) n += t.nbytes();
  return n;
}

// ---- the backend -------------------------------------------------------------------------------
class RecordingBackend : public Backend {
 public:
  RecordingBackend(intrusive_ptr<Backend> inner, std::vector<int> granks)
      : Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)),
        gid_(next_gid_++), granks_(std::move(granks)) {}

  intrusive_ptr<Backend> inner() const { return inner_; }

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  bool supportsSplitting() const override { return inner_->supportsSplitting(); }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void setTimeout(std::chrono::milliseconds t) override { inner_->setTimeout(t); }
  intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  void enableCollectivesTiming() override { inner_->enableCollectivesTiming(); }
  void eagerConnectSingleDevice(at::Device d) override { inner_->eagerConnectSingleDevice(d); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }
  void registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& h) override {
    inner_->registerOnCompletionHook(std::move(h));
  }

  void startCoalescing() override {
    auto& log = the_log();
    {
      std::lock_guard<std::mutex> g(log.mu);
      log.add(E_COAL_START);
    }
    inner_->startCoalescing();
  }
  intrusive_ptr<Work> endCoalescing() override {
    intrusive_ptr<Work> w;
    auto& log = the_log();
    try {
      w = inner_->endCoalescing();
    } catch (...) {
      std::lock_guard<std::mutex> g(log.mu);
      log.add(E_BATCH, 0, 0, 0, -1, -1, -1, log.point(true));
      throw;
    }
    std::lock_guard<std::mutex> g(log.mu);
    log.last_sync_ = -1;
    if (!w) {
      log.add(E_BATCH, 0, 0, 0, -1, -1, -1, log.point(true));
      return w;
    }
    int32_t wid = log.new_work(0, 0);
    if (log.cuda_live_) log.watch_duration(wid, w);
    log.add(E_BATCH, 0, 0, 0, wid);
    return c10::make_intrusive<RecordedWork>(w, wid, false, nullptr);
  }

  // ---- collectives ----
  intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    int64_t nb = nbytes(ts);
    return call({{ALL_REDUCE, A_ALLREDUCE, Red(o.reduceOp), &ts[0], -1, 0, nb, nb}},
                is_sync(o), [&] { return inner_->allreduce(ts, o); });
  }
  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                          const c10d::AllreduceCoalescedOptions& o) override {
    std::vector<RowSpec> specs;
    for (auto& t : ts) specs.push_back({ALL_REDUCE, A_ALLREDUCE_COAL, Red(o.reduceOp), &t, -1, 0,
                                        (int64_t)t.nbytes(), (int64_t)t.nbytes()});
    return call(specs, is_sync(o), [&] { return inner_->allreduce_coalesced(ts, o); });
  }
  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outs,
                                std::vector<at::Tensor>& ins, const c10d::AllgatherOptions& o) override {
    int64_t ob = 0;
    for (auto& l : outs) ob += nbytes(l);
    return call({{ALL_GATHER, A_ALLGATHER, -1, &ins[0], -1, 0, nbytes(ins), ob}}, is_sync(o),
                [&] { return inner_->allgather(outs, ins, o); });
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                      const c10d::AllgatherOptions& o) override {
    return call({{ALL_GATHER, A_AG_BASE, -1, &in, -1, 0, (int64_t)in.nbytes(), (int64_t)out.nbytes()}},
                is_sync(o), [&] { return inner_->_allgather_base(out, in, o); });
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                          std::vector<at::Tensor>& ins,
                                          const c10d::AllgatherOptions& o) override {
    std::vector<RowSpec> specs;
    for (size_t i = 0; i < ins.size() && i < outs.size(); ++i)
      specs.push_back({ALL_GATHER, A_AG_COAL, -1, &ins[i], -1, 0, (int64_t)ins[i].nbytes(), nbytes(outs[i])});
    return call(specs, is_sync(o), [&] { return inner_->allgather_coalesced(outs, ins, o); });
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                      std::vector<at::Tensor>& ins,
                                                      const c10d::AllgatherOptions& o) override {
    std::vector<RowSpec> specs;
    for (size_t i = 0; i < ins.size() && i < outs.size(); ++i)
      specs.push_back({ALL_GATHER, A_AG_INTO_COAL, -1, &ins[i], -1, 0, (int64_t)ins[i].nbytes(),
                       (int64_t)outs[i].nbytes()});
    return call(specs, is_sync(o),
                [&] { return inner_->allgather_into_tensor_coalesced(outs, ins, o); });
  }
  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outs,
                                     std::vector<std::vector<at::Tensor>>& ins,
                                     const c10d::ReduceScatterOptions& o) override {
    int64_t ib = 0;
    for (auto& l : ins) ib += nbytes(l);
    return call({{REDUCE_SCATTER, A_RS, Red(o.reduceOp), &ins[0][0], -1, 0, ib, nbytes(outs)}},
                is_sync(o), [&] { return inner_->reduce_scatter(outs, ins, o); });
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& o) override {
    return call({{REDUCE_SCATTER, A_RS_BASE, Red(o.reduceOp), &in, -1, 0, (int64_t)in.nbytes(),
                  (int64_t)out.nbytes()}},
                is_sync(o), [&] { return inner_->_reduce_scatter_base(out, in, o); });
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                      std::vector<at::Tensor>& ins,
                                                      const c10d::ReduceScatterOptions& o) override {
    std::vector<RowSpec> specs;
    for (size_t i = 0; i < ins.size() && i < outs.size(); ++i)
      specs.push_back({REDUCE_SCATTER, A_RS_COAL, Red(o.reduceOp), &ins[i], -1, 0,
                       (int64_t)ins[i].nbytes(), (int64_t)outs[i].nbytes()});
    return call(specs, is_sync(o),
                [&] { return inner_->reduce_scatter_tensor_coalesced(outs, ins, o); });
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& osp,
                                    std::vector<int64_t>& isp, const c10d::AllToAllOptions& o) override {
    RowSpec s{ALL_TO_ALL, A_A2A_BASE, -1, &in, -1, 0, (int64_t)in.nbytes(), (int64_t)out.nbytes()};
    s.insp = &isp;
    s.outsp = &osp;
    return call({s}, is_sync(o), [&] { return inner_->alltoall_base(out, in, osp, isp, o); });
  }
  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                               const c10d::AllToAllOptions& o) override {
    std::vector<int64_t> isp, osp;
    for (auto& t : ins) isp.push_back(t.dim() ? t.size(0) : 1);
    for (auto& t : outs) osp.push_back(t.dim() ? t.size(0) : 1);
    RowSpec s{ALL_TO_ALL, A_ALLTOALL, -1, &ins[0], -1, 0, nbytes(ins), nbytes(outs)};
    s.insp = &isp;
    s.outsp = &osp;
    return call({s}, is_sync(o), [&] { return inner_->alltoall(outs, ins, o); });
  }
  intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    int64_t nb = nbytes(ts);
    bool root = o.rootRank == getRank();
    return call({{BROADCAST, A_BROADCAST, -1, &ts[0], global(o.rootRank), 0, root ? nb : 0, root ? 0 : nb}},
                is_sync(o), [&] { return inner_->broadcast(ts, o); });
  }
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    int64_t nb = nbytes(ts);
    return call({{REDUCE, A_REDUCE, Red(o.reduceOp), &ts[0], global(o.rootRank), 0, nb,
                  o.rootRank == getRank() ? nb : 0}},
                is_sync(o), [&] { return inner_->reduce(ts, o); });
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                             const c10d::GatherOptions& o) override {
    int64_t ob = 0;
    for (auto& l : outs) ob += nbytes(l);
    return call({{GATHER, A_GATHER, -1, &ins[0], global(o.rootRank), 0, nbytes(ins), ob}}, is_sync(o),
                [&] { return inner_->gather(outs, ins, o); });
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                              const c10d::ScatterOptions& o) override {
    int64_t ib = 0;
    for (auto& l : ins) ib += nbytes(l);
    const at::Tensor* t = (!ins.empty() && !ins[0].empty()) ? &ins[0][0] : &outs[0];
    return call({{SCATTER, A_SCATTER, -1, t, global(o.rootRank), 0, ib, nbytes(outs)}}, is_sync(o),
                [&] { return inner_->scatter(outs, ins, o); });
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override {
    RowSpec s{BARRIER, A_BARRIER, -1, nullptr, -1, 0, 0, 0};
    s.cuda = o.device.has_value() && o.device->is_cuda();
    return call({s}, is_sync(o), [&] { return inner_->barrier(o); });
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override {
    RowSpec s{BARRIER, A_MON_BARRIER, -1, nullptr, -1, 0, 0, 0};
    s.cuda = false;
    call({s}, true, [&] {
      inner_->monitoredBarrier(o, wait_all);
      return intrusive_ptr<Work>();
    });
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return call({{SEND, A_SEND, -1, &ts[0], global(dst), tag, nbytes(ts), 0}}, take_p2p_sync(),
                [&] { return inner_->send(ts, dst, tag); });
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return call({{RECV, A_RECV, -1, &ts[0], global(src), tag, 0, nbytes(ts)}}, take_p2p_sync(),
                [&] { return inner_->recv(ts, src, tag); });
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return call({{RECV, A_RECV_ANY, -1, &ts[0], -1, tag, 0, nbytes(ts)}}, take_p2p_sync(),
                [&] { return inner_->recvAnysource(ts, tag); }, true);
  }

  intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                               const std::vector<int>& ranks,
                               const c10::intrusive_ptr<Options>& opts) override {
    auto b = inner_->split(store, ranks, opts);
    if (!b) return b;
    std::vector<int> granks;
    for (int r : ranks) granks.push_back(global(r));
    std::sort(granks.begin(), granks.end());
    return c10::make_intrusive<RecordingBackend>(b, granks);
  }

  // The backend's number in the log's rows: Python maps it to its group's name and ranks at
  // exit (a backend split from this one in C++ gets its own).
  int32_t gid_;
  std::vector<int> granks_;

 private:
  struct RowSpec {
    int16_t op, api;
    Red red;
    const at::Tensor* t;
    int32_t peer, tag;
    int64_t inb, outb;
    bool cuda = true;  // taken from the tensor when there is one
    const std::vector<int64_t>* insp = nullptr;
    const std::vector<int64_t>* outsp = nullptr;
  };

  int32_t global(int r) const {
    return (r >= 0 && r < static_cast<int>(granks_.size())) ? granks_[r] : -1;
  }

  bool take_p2p_sync() {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    bool s = log.sync_p2p_ != 0;
    log.sync_p2p_ = 0;
    return s;
  }

  template <typename F>
  intrusive_ptr<Work> call(const std::vector<RowSpec>& specs, bool sync, F&& fn,
                           bool anysource = false) {
    auto& log = the_log();
    log.free_buried(false);  // earlier Works their worker let go of (no lock, no GIL held here)
    int64_t t0 = steady_ns();
    int64_t p_issue;
    int32_t row0 = -1;
    size_t mark;
    {
      // rows first: a backend may consume its arguments (gloo moves the split sizes)
      std::lock_guard<std::mutex> g(log.mu);
      p_issue = log.point(true);
      mark = log.mark_rows();
      for (auto& s : specs) {
        bool cuda = s.t ? s.t->is_cuda() : s.cuda;
        int32_t r = log.add_row(s.op, s.api, s.red, s.t, gid_, s.peer, s.tag, s.inb, s.outb,
                                cuda, s.insp, s.outsp);
        if (row0 < 0) row0 = r;
      }
    }
    intrusive_ptr<Work> w;
    int64_t t1 = steady_ns();
    try {
      ScopedCallRows rows(row0, static_cast<int32_t>(specs.size()));  // what a PrunedLane reads
      w = fn();
    } catch (...) {  // a backend that raises leaves no trace of the call
      std::lock_guard<std::mutex> g(log.mu);
      log.drop_rows(mark);
      throw;
    }
    int64_t t2 = steady_ns();
    std::lock_guard<std::mutex> g(log.mu);
    log.self.calls++;
    log.self.inner_call_ns += t2 - t1;
    int64_t p_ret = log.point(false);
    bool first_bwd = log.check_backward();
    int32_t n = static_cast<int32_t>(specs.size());
    int8_t flag = (sync ? 1 : 0) | (first_bwd ? 2 : 0);
    log.last_sync_ = -1;
    if (!w) {
      log.add(E_CALL, flag, row0, n, -1, p_issue, p_ret, log.point(true));
      log.self.call_ns += (t1 - t0) + (steady_ns() - t2);
      return w;
    }
    int32_t wid = log.new_work(row0, n);
    if (sync) {
      log.last_sync_ = wid;
    } else if (log.cuda_live_) {
      log.watch_duration(wid, w);
    } else {
      log.watch_future(wid, w);
    }
    log.add(E_CALL, flag, row0, n, wid, p_issue, p_ret);
    auto rw = c10::make_intrusive<RecordedWork>(w, wid, anysource, &granks_);
    log.self.call_ns += (t1 - t0) + (steady_ns() - t2);
    return rw;
  }

  intrusive_ptr<Backend> inner_;
  static std::atomic<int32_t> next_gid_;
};
std::atomic<int32_t> RecordingBackend::next_gid_{0};

}  // namespace prism

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace prism;
  py::module_::import("torch.distributed");
  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(m, "RecordingBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& inner, std::vector<int> granks) {
        return c10::make_intrusive<RecordingBackend>(inner, std::move(granks));
      }))
      .def_property_readonly("inner", &RecordingBackend::inner)
      .def_readonly("gid", &RecordingBackend::gid_)
      .def_readonly("global_ranks", &RecordingBackend::granks_);
  py::class_<PrunedLane, c10d::Backend, c10::intrusive_ptr<PrunedLane>>(m, "PrunedLane")
      .def(py::init([](int rank, int size, py::object backend, std::string name, bool coalescing, bool check,
                       const std::vector<std::tuple<int16_t, int64_t, int64_t, int32_t>>& expected) {
        std::vector<PrunedLane::Expected> ex;
        ex.reserve(expected.size());
        for (auto& [op, inb, outb, root] : expected) ex.push_back({op, inb, outb, root});
        return c10::make_intrusive<PrunedLane>(rank, size, std::move(backend), std::move(name), coalescing,
                                               check, std::move(ex));
      }))
      .def_property_readonly("backend", &PrunedLane::backend);
  m.def("exclude", [](int64_t ns) { the_log().exclude(ns); });
  m.def("set_left_out_board", [](int64_t address) { the_log().set_left_out_board(address); });
  m.def("excluded_ns", [] { return the_log().excluded_ns(); });
  m.def("lane_stats", [] {
    auto& s = PrunedLane::stats();
    py::dict d;
    d["fast"] = s.fast; d["fast_ns"] = s.fast_ns; d["fast_issue_ns"] = s.fast_issue_ns;
    d["python"] = s.python; d["python_ns"] = s.python_ns;
    return d;
  });
  m.def("set_cuda", [](bool on) { the_log().cuda_ = on; });
  // off: no async Work is held to read NCCL's time of it (prism emulate; see comm/install.py)
  m.def("set_durations", [](bool on) { the_log().durations_ok_ = on; });
  // off: CUDA events at the iteration boundaries only (prism emulate: each is device time between
  // two of the program's kernels that its real run does not spend)
  m.def("set_all_points_on_device", [](bool on) { the_log().all_points_on_device_ = on; });
  m.def("start", [] {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    log.add(E_START, 0, 0, 0, -1, log.point(true, true));
  });
  m.def("boundary", [](bool explicit_) { the_log().boundary(explicit_); });
  m.def("mark", [](const std::string& label) {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    log.labels_.push_back(label);
    log.last_sync_ = -1;  // a call issued sync and not waited at once is async after all
    log.add(E_MARK, 0, static_cast<int32_t>(log.labels_.size() - 1), 0, -1, log.point(true));
  });
  m.def("coalesce_begin", [](int flag) {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    log.add(E_COAL_BEGIN, static_cast<int8_t>(flag));
  });
  m.def("coalesce_end", [] {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    log.add(E_COAL_END);
  });
  m.def("sync_p2p", [](bool on) { the_log().sync_p2p_ = on ? 1 : 0; });
  m.def("finish", [] { the_log().finish(); }, py::call_guard<py::gil_scoped_release>());
  m.def("export", [] { return the_log().export_log(); });
  m.def("self_time", [] {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    auto& t = log.self;
    py::dict d;
    d["calls"] = t.calls; d["call_ns"] = t.call_ns; d["inner_call_ns"] = t.inner_call_ns;
    d["waits"] = t.waits; d["wait_ns"] = t.wait_ns; d["inner_wait_ns"] = t.inner_wait_ns;
    d["boundaries"] = t.boundaries; d["boundary_ns"] = t.boundary_ns;
    return d;
  });
  // Where the rank stands (prismllm.status): counts, its last call's row and the awaited one's.
  m.def("status", [] {
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    auto row = [&](int64_t k) -> py::object {
      const Row* r = log.row_at(k);
      if (r == nullptr) return py::none();
      return py::make_tuple(k, r->op, r->gid, r->peer);
    };
    py::dict d;
    d["calls"] = log.self.calls; d["waits"] = log.self.waits; d["boundaries"] = log.self.boundaries;
    d["last"] = row(log.num_rows() - 1);
    int32_t w = log.waiting_;
    d["waiting"] = (w >= 0 && w < static_cast<int32_t>(log.works_.size())) ? row(log.works_[w].row0) : py::none();
    return d;
  });
  m.attr("OPS") = std::vector<std::string>(std::begin(kOps), std::end(kOps));
  m.attr("APIS") = std::vector<std::string>(std::begin(kApis), std::end(kApis));
}
