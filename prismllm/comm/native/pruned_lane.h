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

// A Work of the Python backend, kept together with its Python object (whose methods the
// trampoline calls), released under the GIL.
class HeldWork : public Work {
 public:
  explicit HeldWork(py::object obj)
      : Work(-1, c10d::OpType::UNKNOWN), work_(obj.cast<intrusive_ptr<Work>>()), obj_(std::move(obj)) {}
  ~HeldWork() override {
    work_.reset();  // the trampoline's C++ part: its Python object is obj_
    drop(obj_);
  }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  void synchronize() override { work_->synchronize(); }
  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override { return work_->exception(); }
  int sourceRank() const override { return work_->sourceRank(); }
  std::vector<at::Tensor> result() override { return work_->result(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }
  float getDuration() const override { return work_->getDuration(); }
  void abort() override { work_->abort(); }

 private:
  intrusive_ptr<Work> work_;
  py::object obj_;
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
    int64_t fast = 0, fast_ns = 0, python = 0, python_ns = 0;
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
    if (ts.size() == 1) {
      std::vector<at::Tensor> prog{ts[0]};
      if (auto w = fast(A_ALLREDUCE, prog, -1)) return w;
    }
    return python("allreduce", A_ALLREDUCE, ts, ts, o);
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    std::vector<at::Tensor> prog{out, in};
    if (auto w = fast(A_AG_BASE, prog, -1)) return w;
    return python("_allgather_base", A_AG_BASE, prog, out, in, o);
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& o) override {
    std::vector<at::Tensor> prog{out, in};
    if (auto w = fast(A_RS_BASE, prog, -1)) return w;
    return python("_reduce_scatter_base", A_RS_BASE, prog, out, in, o);
  }
  intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    if (ts.size() == 1) {
      std::vector<at::Tensor> prog{ts[0]};
      if (auto w = fast(A_BROADCAST, prog, static_cast<int32_t>(o.rootRank))) return w;
    }
    return python("broadcast", A_BROADCAST, ts, ts, o);
  }

  // ---- the calls that always go to Python ----
  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                          const c10d::AllreduceCoalescedOptions& o) override {
    return python("allreduce_coalesced", -1, {}, ts, o);
  }
  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                const c10d::AllgatherOptions& o) override {
    return python("allgather", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                          std::vector<at::Tensor>& ins, const c10d::AllgatherOptions& o) override {
    return python("allgather_coalesced", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                      const c10d::AllgatherOptions& o) override {
    return python("allgather_into_tensor_coalesced", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                                     const c10d::ReduceScatterOptions& o) override {
    return python("reduce_scatter", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                      const c10d::ReduceScatterOptions& o) override {
    return python("reduce_scatter_tensor_coalesced", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& osp,
                                    std::vector<int64_t>& isp, const c10d::AllToAllOptions& o) override {
    return python("alltoall_base", -1, {}, out, in, osp, isp, o);
  }
  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                               const c10d::AllToAllOptions& o) override {
    return python("alltoall", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    return python("reduce", -1, {}, ts, o);
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                             const c10d::GatherOptions& o) override {
    return python("gather", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                              const c10d::ScatterOptions& o) override {
    return python("scatter", -1, {}, outs, ins, o);
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override { return python("barrier", -1, {}, o); }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override {
    python("monitored_barrier", -1, {}, py::none(), wait_all);
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return python("send", -1, {}, ts, dst, tag);
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return python("recv", -1, {}, ts, src, tag);
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return python("recv_anysource", -1, {}, ts, tag);
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
  std::vector<CallRow> call_rows() {
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
  // Sequence numbers for the rows, taken (``take``) only once the call went through.
  void number(std::vector<CallRow>& rows, bool take) {
    int64_t coll = coll_seq_;
    std::map<std::pair<int16_t, int32_t>, int64_t> p2p;
    for (auto& r : rows) {
      if (r.op == SEND || r.op == RECV) {
        auto key = std::make_pair(r.op, r.peer);
        auto it = p2p.find(key);
        int64_t s = it != p2p.end() ? it->second : (p2p_seq_.count(key) ? p2p_seq_[key] : 0);
        r.seq = s;
        p2p[key] = s + 1;
      } else {
        r.seq = coll++;
      }
    }
    if (take) {
      coll_seq_ = coll;
      for (auto& [k, v] : p2p) p2p_seq_[k] = v;
    }
  }

  static std::vector<int64_t> key_of(int16_t api, const std::vector<at::Tensor>& prog, const CallRow& r,
                                     int32_t root) {
    std::vector<int64_t> key{api, r.red, root};
    for (auto& t : prog) {
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

  // The call on the small communicator from its template, or nothing (then Python plans it).
  intrusive_ptr<Work> fast(int16_t api, std::vector<at::Tensor>& prog, int32_t root) {
    if (scope_ > 0) return {};
    for (auto& t : prog)
      if (!t.is_contiguous()) return {};
    int64_t t0 = steady_ns();
    auto rows = call_rows();
    if (rows.size() != 1 || rows[0].red == static_cast<int8_t>(c10d::ReduceOp::PREMUL_SUM)) return {};
    Template tp;
    intrusive_ptr<Backend> small;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!small_) return {};
      small = small_;
      number(rows, false);
      if (!expected_here(rows[0])) return {};
      auto it = templates_.find(key_of(api, prog, rows[0], root));
      if (it == templates_.end()) return {};
      tp = it->second;
    }
    auto w = issue(*small, tp, prog);
    {
      std::lock_guard<std::mutex> g(mu_);
      number(rows, true);
    }
    auto& s = stats();
    s.fast++;
    s.fast_ns += steady_ns() - t0;
    return w;
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

  // As prismllm.pruning.executor.issue issues these small calls (default options).
  intrusive_ptr<Work> issue(Backend& small, const Template& t, std::vector<at::Tensor>& prog) {
    switch (t.op) {
      case ALL_REDUCE: {
        std::vector<at::Tensor> v{place(t.in, prog)};
        if (t.pad.defined()) {
          v.push_back(t.pad);
          c10d::AllreduceCoalescedOptions o;
          o.reduceOp = reduce_op(t);
          return small.allreduce_coalesced(v, o);
        }
        c10d::AllreduceOptions o;
        o.reduceOp = reduce_op(t);
        return small.allreduce(v, o);
      }
      case ALL_GATHER: {
        at::Tensor out = place(t.out, prog), in = place(t.in, prog);
        return small._allgather_base(out, in, c10d::AllgatherOptions());
      }
      case REDUCE_SCATTER: {
        at::Tensor out = place(t.out, prog), in = place(t.in, prog);
        c10d::ReduceScatterOptions o;
        o.reduceOp = reduce_op(t);
        return small._reduce_scatter_base(out, in, o);
      }
      default: {  // BROADCAST
        std::vector<at::Tensor> v{place(t.in, prog)};
        c10d::BroadcastOptions o;
        o.rootRank = t.root;
        o.rootTensor = 0;
        return small.broadcast(v, o);
      }
    }
  }

  // The call through the Python backend; ``api`` >= 0: a call that can take the fast lane, whose
  // template Python may hand back (for ``prog``, the program's tensors in the lane's order).
  template <typename... A>
  intrusive_ptr<Work> python(const char* method, int16_t api, std::vector<at::Tensor> prog, A&&... args) {
    int64_t t0 = steady_ns();
    auto rows = call_rows();
    {
      std::lock_guard<std::mutex> g(mu_);
      number(rows, false);
    }
    int32_t root = -1;
    if constexpr (sizeof...(A) > 0) root = root_of(args...);
    intrusive_ptr<Work> w;
    {
      py::gil_scoped_acquire gil;
      py::list pyrows;
      for (auto& r : rows)
        pyrows.append(py::make_tuple(kOps[r.op], kApis[r.api], r.seq, r.red,
                                     std::isnan(r.factor) ? py::object(py::none()) : py::object(py::float_(r.factor)),
                                     r.inb, r.outb));
      py::tuple res = py_.attr("native_call")(method, pyrows, to_py(args)...);
      w = held(res[0]);
      if (api >= 0 && rows.size() == 1 && scope_ == 0 && !res[1].is_none()) {
        Template tp = template_of(res[1].cast<py::tuple>());
        auto small = res[2].is_none() ? intrusive_ptr<Backend>() : res[2].cast<intrusive_ptr<Backend>>();
        std::lock_guard<std::mutex> g(mu_);
        templates_.emplace(key_of(api, prog, rows[0], root), std::move(tp));
        if (!small_) small_ = small;
      }
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      number(rows, true);
    }
    auto& s = stats();
    s.python++;
    s.python_ns += steady_ns() - t0;
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

  template <typename O, typename... R>
  static int32_t root_of(const O& first, const R&... rest) {
    if constexpr (std::is_same_v<std::decay_t<O>, c10d::BroadcastOptions>) {
      return static_cast<int32_t>(first.rootRank);
    } else if constexpr (sizeof...(R) > 0) {
      return root_of(rest...);
    } else {
      return -1;
    }
  }

  // (op, red, factor, root, (in arg, offset, numel), (out arg, offset, numel), pad tensor or None)
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
    return Template{t[0].cast<int16_t>(), t[1].cast<int8_t>(), t[2].cast<double>(), t[3].cast<int32_t>(),
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
