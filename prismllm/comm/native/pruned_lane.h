// PrunedLane: the inner backend of a pruned group in emulation's native lane (a group some of
// whose members are virtual; prismllm/comm/sandbox.py has the Python design). It stands where
// the real backend would, under a RecordingBackend, so that a call the program issues reaches
// the small communicator (the real members and the assistant's proxy) with no Python on the way,
// as a real collective reaches NCCL:
//
// - the call is checked against the rank's graph (the expected op and bytes of each collective
//   on this group, handed over at creation);
// - its small call comes from a template: what Python's pruning plan issued for the first call of
//   the same signature (api, dtype, sizes, reduce op, root), with the program's tensors put where
//   that call had them. Only a plan whose small call reads and writes the program's own tensors
//   (and, for padding, a buffer no one reads back) with no step before or after the call makes a
//   template: an all-reduce (NCCL's pre-multiplied sum carries the group's scaling), an
//   all-gather or reduce-scatter into the program's tensors, a broadcast from a real root.
//
// Every other call (the first of each signature, a call the graph check refuses, a call inside a
// coalescing scope, point-to-point, objects, anything with a post step) goes to the Python
// backend (``PrunedBackend.native_call``), which plans, checks, issues and may hand back a
// template; its Work is held with its Python object (HeldWork). Calls keep the program's order on
// the small communicator: both paths issue on the calling thread.
//
// Included by recording_backend.cpp (one translation unit: the lane reads the rows the recording
// backend just logged for the call).

// The rows the RecordingBackend logged for the call it is handing to its inner backend now.
struct CallRows {
  int64_t row0 = -1;
  int32_t n = 0;
};
static thread_local CallRows tl_call_rows;

struct ScopedCallRows {
  CallRows prev;
  ScopedCallRows(int64_t row0, int32_t n) : prev(tl_call_rows) { tl_call_rows = {row0, n}; }
  ~ScopedCallRows() { tl_call_rows = prev; }
};

// Lets go of a Python object from C++: under the GIL, or, once the interpreter is gone, not at all
// (the object went with it).
static void drop(py::object& o) {
  if (!Py_IsInitialized()) {
    o.release();
    return;
  }
  py::gil_scoped_acquire gil;
  o = py::object();
}

// A Work of the Python backend, kept together with its Python object, released under the GIL.
// c10d's trampoline for a Work written in Python forwards only wait and get_future: asked from
// C++, such a Work never completes and has no duration. The native recorder holds an async
// Work until it completes (to read NCCL's device time), so every Work of the Python path was
// held for the rest of the run, with its tensors (seen on four H100s: a pipeline's sandbox
// stage grew 268 MB an iteration, DDP's peak stayed 1.07 GB over the larger of its real runs').
// Completion and duration are asked of the Python object instead: whether its small calls ran
// on the device (``_device_completed``, which leaves the post step to the program's thread) and
// their time.
class HeldWork : public ForwardingWork {
 public:
  explicit HeldWork(py::object obj)
      : ForwardingWork(obj.cast<intrusive_ptr<Work>>(), c10d::OpType::UNKNOWN), obj_(std::move(obj)) {
    completed_fn_ = py::getattr(obj_, "_device_completed", py::getattr(obj_, "is_completed"));
    duration_fn_ = py::getattr(obj_, "_get_duration", py::none());
  }
  ~HeldWork() override {
    inner_.reset();  // the trampoline's C++ part: its Python object is obj_
    drop(completed_fn_);
    drop(duration_fn_);
    drop(obj_);
  }

  bool isCompleted() override {
    if (done_.load(std::memory_order_acquire)) return true;
    if (!Py_IsInitialized()) return true;  // the interpreter, and the call's tensors, are gone
    py::gil_scoped_acquire gil;
    bool done = completed_fn_().cast<bool>();
    if (done) done_.store(true, std::memory_order_release);
    return done;
  }

  // NCCL's device time of the small calls, in ms; 0 (none) for a Work that has no such time.
  float getDuration() const override {
    if (!Py_IsInitialized()) return 0;
    py::gil_scoped_acquire gil;
    return duration_fn_.is_none() ? 0.0f : duration_fn_().cast<float>();
  }

 private:
  py::object obj_, completed_fn_, duration_fn_;
  std::atomic<bool> done_{false};
};

class PrunedLane : public Backend {
 public:
  // Where a small call's tensor lies: program tensor ``arg`` (flattened), ``numel`` elements
  // from ``offset``.
  struct Role {
    int32_t arg = -1;
    int64_t offset = 0, numel = 0;
  };
  struct Template {
    int16_t op = ALL_REDUCE;  // Op: ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST
    int8_t red = -1;          // the small call's ReduceOp code (-1: none)
    double factor = 0;        // PREMUL_SUM's factor (NaN: a plain op)
    int32_t root = -1;        // small rank (broadcast)
    Role in, out;
    at::Tensor pad;  // all-reduce padding, issued in the same batch (undefined: none)
  };
  // One collective of the rank's graph on this group: op, bytes in and out, root (global, -1).
  struct Expected {
    int16_t op;
    int64_t inb, outb;
    int32_t root;
  };
  struct Stats {
    // fast_issue_ns: the part of fast_ns in the small call itself (the small backend's own
    // issue, NCCL's on GPUs); the rest is the lane's check and template
    int64_t fast = 0, fast_ns = 0, fast_issue_ns = 0, python = 0, python_ns = 0;
  };
  static Stats& stats() {
    static Stats s;
    return s;
  }

  // ``expected``: the rank's collectives on this group by seq, from its graph; ``check`` false
  // where there is no graph to check against (as the Python path then checks nothing).
  PrunedLane(int rank, int size, py::object py, std::string name, bool coalescing, bool check,
             std::vector<Expected> expected)
      : Backend(rank, size), py_(std::move(py)), name_(std::move(name)), coalescing_ok_(coalescing),
        check_(check), expected_(std::move(expected)) {}
  ~PrunedLane() override { drop(py_); }

  py::object backend() const { return py_; }  // the Python backend
  const std::string getBackendName() const override { return name_; }
  bool supportsCoalescing() const override { return coalescing_ok_; }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    small_.reset();
    py_.attr("shutdown")();
  }

  // The Python backend batches a scope's calls as one NCCL group only when told the device is CUDA
  // (c10d's startCoalescing names none): told nothing, it would post a pipeline's sends and receives
  // one by one, which can deadlock on NCCL.
  void startCoalescing() override {
    ++scope_;
    py::gil_scoped_acquire gil;
    py_.attr("_start_coalescing")(scope_device());
  }
  intrusive_ptr<Work> endCoalescing() override {
    --scope_;
    py::gil_scoped_acquire gil;
    return held(py_.attr("_end_coalescing")(scope_device()));
  }

  // ---- the calls that can take the fast lane ----
  intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    LaneCall c(A_ALLREDUCE, ts, is_sync(o));
    intrusive_ptr<Work> w;
    if (fast(c, w)) return w;
    return python("allreduce", c, ts, o);
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    LaneCall c(A_AG_BASE, {out, in}, is_sync(o));
    intrusive_ptr<Work> w;
    if (fast(c, w)) return w;
    return python("_allgather_base", c, out, in, o);
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& o) override {
    LaneCall c(A_RS_BASE, {out, in}, is_sync(o));
    intrusive_ptr<Work> w;
    if (fast(c, w)) return w;
    return python("_reduce_scatter_base", c, out, in, o);
  }
  intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    LaneCall c(A_BROADCAST, ts, is_sync(o), static_cast<int32_t>(o.rootRank));
    intrusive_ptr<Work> w;
    if (fast(c, w)) return w;
    return python("broadcast", c, ts, o);
  }

  // ---- the calls that always go to Python ----
  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                          const c10d::AllreduceCoalescedOptions& o) override {
    return python("allreduce_coalesced", LaneCall(), ts, o);
  }
  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                const c10d::AllgatherOptions& o) override {
    return python("allgather", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                          std::vector<at::Tensor>& ins, const c10d::AllgatherOptions& o) override {
    return python("allgather_coalesced", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                      const c10d::AllgatherOptions& o) override {
    return python("allgather_into_tensor_coalesced", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                     const c10d::ReduceScatterOptions& o) override {
    return python("reduce_scatter", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                      const c10d::ReduceScatterOptions& o) override {
    return python("reduce_scatter_tensor_coalesced", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& osp,
                                    std::vector<int64_t>& isp, const c10d::AllToAllOptions& o) override {
    return python("alltoall_base", LaneCall(), out, in, osp, isp, o);
  }
  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                               const c10d::AllToAllOptions& o) override {
    return python("alltoall", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    return python("reduce", LaneCall(), ts, o);
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                             const c10d::GatherOptions& o) override {
    return python("gather", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                              const c10d::ScatterOptions& o) override {
    return python("scatter", LaneCall(), outs, ins, o);
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override { return python("barrier", LaneCall(), o); }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override {
    python("monitored_barrier", LaneCall(), py::none(), wait_all);
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return python("send", LaneCall(), ts, dst, tag);
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return python("recv", LaneCall(), ts, src, tag);
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return python("recv_anysource", LaneCall(), ts, tag);
  }
  intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>&, const std::vector<int>&,
                               const c10::intrusive_ptr<Options>&) override {
    py::gil_scoped_acquire gil;
    py_.attr("split_group")();  // raises the emulation's message
    return {};
  }

 private:
  // The call's rows in the log: (op, api, seq, red code, factor, peer, in bytes, out bytes) each,
  // seq numbered as the Python recorder numbers it (collectives on the group from 0; a send or
  // recv among those with the same peer).
  struct CallRow {
    int16_t op, api;
    int64_t seq;
    int8_t red;
    double factor;
    int32_t peer;
    int64_t inb, outb;
  };
  // A call as the lane sees it, from the moment it arrived: its rows in the log and, for one that
  // can take the fast lane (``api`` >= 0), the program's tensors in the lane's order and its root.
  struct LaneCall {
    int64_t t0 = steady_ns();
    std::vector<CallRow> rows = logged_rows();
    int16_t api = -1;
    std::vector<at::Tensor> prog;
    bool sync = false;  // the program's async_op=False: the small call too (set_sync)
    int32_t root = -1;
    LaneCall() = default;
    LaneCall(int16_t api, std::vector<at::Tensor> prog, bool sync, int32_t root = -1)
        : api(api), prog(std::move(prog)), sync(sync), root(root) {}
  };
  static std::vector<CallRow> logged_rows() {
    std::vector<CallRow> out;
    CallRows cr = tl_call_rows;
    auto& log = the_log();
    std::lock_guard<std::mutex> g(log.mu);
    for (int32_t i = 0; i < cr.n; ++i) {
      const Row* r = log.row_at(cr.row0 + i);
      if (r == nullptr) break;
      out.push_back({r->op, r->api, -1, r->red, r->factor, r->peer, r->inb, r->outb});
    }
    return out;
  }
  static bool p2p(const CallRow& r) { return r.op == SEND || r.op == RECV; }
  // Sequence numbers for the rows, from the group's counters (under mu_).
  void number(std::vector<CallRow>& rows) const {
    int64_t coll = coll_seq_;
    std::map<std::pair<int16_t, int32_t>, int64_t> next;
    for (auto& r : rows) {
      if (!p2p(r)) {
        r.seq = coll++;
        continue;
      }
      auto key = std::make_pair(r.op, r.peer);
      auto taken = p2p_seq_.find(key);
      auto it = next.try_emplace(key, taken != p2p_seq_.end() ? taken->second : 0).first;
      r.seq = it->second++;
    }
  }
  // The call went through: its rows' numbers are taken, and its host time counted.
  void done(const LaneCall& c, bool fast) {
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& r : c.rows) {
        if (p2p(r)) {
          p2p_seq_[{r.op, r.peer}] = r.seq + 1;
        } else {
          coll_seq_ = r.seq + 1;
        }
      }
    }
    auto& s = stats();
    (fast ? s.fast : s.python)++;
    (fast ? s.fast_ns : s.python_ns) += steady_ns() - c.t0;
  }

  static std::vector<int64_t> key_of(const LaneCall& c) {
    std::vector<int64_t> key{c.api, c.rows[0].red, c.root};
    for (auto& t : c.prog) {
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(t.numel());
      key.push_back(static_cast<int64_t>(t.device().type()));
    }
    return key;
  }

  bool expected_here(const CallRow& r) const {
    if (!check_) return true;
    if (r.seq < 0 || r.seq >= static_cast<int64_t>(expected_.size())) return false;
    const Expected& e = expected_[r.seq];
    return e.op == r.op && e.inb == r.inb && e.outb == r.outb && (r.peer < 0 || e.root == r.peer);
  }

  // The call on the small communicator from its template, into ``w`` (no Work for a synchronous
  // call on NCCL, as the real backend returns none), or false (then Python plans it).
  bool fast(LaneCall& c, intrusive_ptr<Work>& w) {
    if (c.api < 0 || scope_ > 0 || c.rows.size() != 1 ||
        c.rows[0].red == static_cast<int8_t>(c10d::ReduceOp::PREMUL_SUM))
      return false;
    for (auto& t : c.prog)
      if (!t.is_contiguous()) return false;
    Template tp;
    intrusive_ptr<Backend> small;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!small_) return false;
      small = small_;
      number(c.rows);
      if (!expected_here(c.rows[0])) return false;
      auto it = templates_.find(key_of(c));
      if (it == templates_.end()) return false;
      tp = it->second;
    }
    // on gloo the host clock is the rank's device clock: the lane's own time (the check and the
    // template) is left out of it, as the Python path leaves out its parts; the call itself stays
    int64_t t_issue = steady_ns();
    if (!coalescing_ok_) the_log().exclude(t_issue - c.t0);
    w = issue(*small, tp, c.prog, c.sync);
    stats().fast_issue_ns += steady_ns() - t_issue;
    done(c, true);
    return true;
  }

  c10d::ReduceOp reduce_op(const Template& t) const {
    if (!std::isnan(t.factor)) {  // as makePreMulSum builds it (named makeNCCLPreMulSum before torch 2.13)
      c10d::ReduceOp op;
      op.op_ = c10d::ReduceOp::PREMUL_SUM;
      op.supplement_ = c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(t.factor);
      return op;
    }
    return c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(t.red));
  }

  static at::Tensor place(const Role& r, std::vector<at::Tensor>& prog) {
    return prog[r.arg].view({-1}).narrow(0, r.offset, r.numel);
  }

  // As prismllm.pruning.executor.issue issues these small calls, synchronous where the program's
  // call is (``sync``).
  intrusive_ptr<Work> issue(Backend& small, const Template& t, std::vector<at::Tensor>& prog, bool sync) {
    switch (t.op) {
      case ALL_REDUCE: {
        std::vector<at::Tensor> v{place(t.in, prog)};
        if (t.pad.defined()) {
          v.push_back(t.pad);
          c10d::AllreduceCoalescedOptions o;
          o.reduceOp = reduce_op(t);
          set_sync(o, sync);
          return small.allreduce_coalesced(v, o);
        }
        c10d::AllreduceOptions o;
        o.reduceOp = reduce_op(t);
        set_sync(o, sync);
        return small.allreduce(v, o);
      }
      case ALL_GATHER: {
        at::Tensor out = place(t.out, prog), in = place(t.in, prog);
        c10d::AllgatherOptions o;
        set_sync(o, sync);
        return small._allgather_base(out, in, o);
      }
      case REDUCE_SCATTER: {
        at::Tensor out = place(t.out, prog), in = place(t.in, prog);
        c10d::ReduceScatterOptions o;
        o.reduceOp = reduce_op(t);
        set_sync(o, sync);
        return small._reduce_scatter_base(out, in, o);
      }
      default: {  // BROADCAST
        std::vector<at::Tensor> v{place(t.in, prog)};
        c10d::BroadcastOptions o;
        o.rootRank = t.root;
        o.rootTensor = 0;
        set_sync(o, sync);
        return small.broadcast(v, o);
      }
    }
  }

  // The call through the Python backend, which may hand back its template (a call that can take
  // the fast lane).
  template <typename... A>
  intrusive_ptr<Work> python(const char* method, LaneCall c, A&&... args) {
    {
      std::lock_guard<std::mutex> g(mu_);
      number(c.rows);
    }
    intrusive_ptr<Work> w;
    {
      py::gil_scoped_acquire gil;
      py::list pyrows;
      for (auto& r : c.rows)
        pyrows.append(py::make_tuple(kOps[r.op], kApis[r.api], r.seq, r.red,
                                     std::isnan(r.factor) ? py::object(py::none()) : py::object(py::float_(r.factor)),
                                     r.inb, r.outb));
      py::object prog = c.api >= 0 ? py::cast(c.prog) : py::object(py::none());
      py::tuple res = py_.attr("native_call")(method, pyrows, prog, to_py(args)...);
      w = held(res[0]);
      if (c.api >= 0 && c.rows.size() == 1 && scope_ == 0 && !res[1].is_none()) {
        Template tp = template_of(res[1].cast<py::tuple>());
        auto small = res[2].is_none() ? intrusive_ptr<Backend>() : res[2].cast<intrusive_ptr<Backend>>();
        std::lock_guard<std::mutex> g(mu_);
        templates_.emplace(key_of(c), std::move(tp));
        if (!small_) small_ = small;
      }
    }
    done(c, false);
    return w;
  }

  template <typename T>
  static py::object to_py(T&& x) {
    if constexpr (std::is_base_of_v<py::handle, std::decay_t<T>>) {
      return py::reinterpret_borrow<py::object>(x);
    } else {
      return py::cast(std::forward<T>(x));
    }
  }

  // (op name, red, factor, root, (in arg, offset, numel), (out arg, offset, numel), pad tensor or None)
  static Template template_of(const py::tuple& t) {
    auto role = [](py::handle h) {
      Role r;
      if (h.is_none()) return r;
      auto x = h.cast<py::tuple>();
      r.arg = x[0].cast<int32_t>();
      r.offset = x[1].cast<int64_t>();
      r.numel = x[2].cast<int64_t>();
      return r;
    };
    auto name = t[0].cast<std::string>();
    auto op = std::find(std::begin(kOps), std::end(kOps), name) - std::begin(kOps);
    return Template{static_cast<int16_t>(op), t[1].cast<int8_t>(), t[2].cast<double>(), t[3].cast<int32_t>(),
                    role(t[4]), role(t[5]), t[6].is_none() ? at::Tensor() : t[6].cast<at::Tensor>()};
  }

  py::object scope_device() const { return coalescing_ok_ ? py::object(py::str("cuda")) : py::object(py::none()); }

  static intrusive_ptr<Work> held(py::handle w) {
    if (w.is_none()) return {};
    return c10::make_intrusive<HeldWork>(py::reinterpret_borrow<py::object>(w));
  }

  py::object py_;
  std::string name_;
  bool coalescing_ok_;
  bool check_;
  std::vector<Expected> expected_;
  intrusive_ptr<Backend> small_;
  std::mutex mu_;  // the templates, the small backend and the sequence numbers (never held in Python)
  std::map<std::vector<int64_t>, Template> templates_;
  int64_t coll_seq_ = 0;
  std::map<std::pair<int16_t, int32_t>, int64_t> p2p_seq_;
  int scope_ = 0;  // open coalescing scopes: their calls go to Python, which batches them
};
