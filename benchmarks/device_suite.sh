#!/usr/bin/env bash
# The GPU measurements still open (issues 10, 12, 13), cut into parts that each fit one device
# call (10 minutes at most), run from the repository root on the device machine:
#
#   bash benchmarks/device_suite.sh PART        # results and logs under $OUT (or out/device)
#
# PART:
#   smoke      prism time + prism emulate --timing real on TP2 and PP2, N = 2, small sizes: the
#              plan-first assistant, batch entry and per-thread CUDA streams, never run on a GPU
#              before (a hang here is the first thing to know); ~3 min
#   fid-a      fidelity rows N = 2: tp, pp (with the noise run); ~6 min (an estimate)
#   fid-b      fidelity rows N = 2: vpp, dpopt, moe, merged into fid-a's JSON (carry it back)
#   overhead   recording overhead, TP2 / PP2 / DP2: plain, native, Python path, profiler, two
#              interleaved rounds (issue 10)
#   gpu1       one GPU (nvidia-h100-x1 / nvidia-h200): `pytest -m gpu` (the emulation's GPU
#              tests share the GPU between sandbox and assistant, NCCL over sockets) and the
#              per-call recording cost (call_cost.py: plain / NCCL timing / recorded, 3 rounds)
#   native-cost  the native recorder's per-call cost (PRISM_NATIVE=1) beside plain, NCCL timing
#              on and the Python path, with the recorder's own time a call, the two graphs
#              compared; first the GPU recording tests with PRISM_NATIVE=1; ROUNDS (3) rounds of ~100 s
#   clock      one GPU: the GPU tests of the real-time schedule and the emulation, then `prism run` of a DDP job
#              at N = 4 on one shared GPU (a padded all-reduce in two parts, the device clock); ~3 min
#   kernels    a DDP job's sandbox rank kernel by kernel (PyTorch profiler): real run, slice, emulation,
#              at N = 2 and 4 (WORLDS), with the emulation's host under cProfile and a real recording; ~7 min
#   ddp-tail   the suite's ddp-2 job (batch 16; TAIL_NAME, TAIL_PROGRAM, TAIL_ARGS, TAIL_LAYOUT: another) kernel by
#              kernel at N = 2: its real run, its slice and its emulation under the PyTorch profiler, summarised by
#              kernel_timeline.py (each kernel's time by name; the tail: what the device ran after the last NCCL kernel
#              of an iteration), with each GPU's SM clock, power and temperature sampled every 100 ms; ~3 min
#   issue-thread  the issue thread's GPU tests, a DDP job's prism run beside its real run, host cost; ~4 min
#   threads    a DDP job's rank at N = 2, real, in its slice and emulated: each host thread's CPU time and
#              context switches at the end (profile_rank.py PROFILE_WITH=threads: nothing during the run);
#              is a slice's host slower because its threads get less CPU? ~3 min
#   ab-concurrent  does a real run beside the prism run (fidelity-gpu --concurrent) move prism's figures? ddp-2
#              both ways, alternated, ROUNDS (2) rounds in one lease: $OUT/ab-<conc|seq><round>.json; ~8 min
#   numa       the machine's topology; ddp-2 real and under prism run, unpinned and pinned to GPU 0's NUMA node's
#              CPUs, alternated, two rounds: does where the host threads run move the time? ~4 min
#   gil        a DDP job's slice and emulation alternated: the issue thread, without it, with a 50 us GIL switch
#              interval; each one's threads' context switches; the job recorded and plain; ~7 min
#   hostprof   where a DDP rank's host time goes, real and emulated: py-spy on each, their threads' CPU time,
#              every busy thread of the machine (top); needs .whl/py_spy-*.whl; ~3 min
#   parts      the emulation layer's host time by part on a DDP job's slice and emulation (60 iterations), top while
#              the emulation runs, the assistant's and the head start's GPU tests; ~6 min
#   headstart  the host's head start of GPU slices: a DDP job's slice with each head start (MODES), the real job,
#              then the head start's GPU test; ~5 min
#   hostcost   the host's cost of an async collective, real and emulated, N = 2 and 4 (issue_cost.py), the
#              emulation's host under cProfile; then each call cold (--between-us 300: host work between calls, as
#              DDP's backward between buckets), real and emulated with and without the issue thread; ~6 min
#   issue-ab   the emulated sandbox with the issue thread and without (PRISM_ISSUE_THREAD=1 / 0), alternated
#              ROUNDS (3) times on one calibrated graph, for the suite's DDP job at N = 2 and 4 (WORLDS) from two GPUs,
#              with the real job twice each; the layer's host time by part and the host wait of each; first the
#              issue thread's GPU tests (a pruned NCCL call, the TP2 and DP2 emulations' values; TESTS=0: none); ~9 min
#   lane-ab    as issue-ab with the native lane on and off (PRISM_NATIVE_LANE=1 / 0), its GPU tests with the lane on
#   lane-tests the native lane's GPU tests alone, every failure's message in $OUT/lane-tests.log; ~3 min
#   gpu-tests  every GPU test file on its own (FILES, PER seconds each, default 180), a log each: $OUT/gpu-<file>.log
#   timestamps what a point of the recorder costs the device (benchmarks/programs/timestamp_cost.py: no point, a
#              plain event, a timing event, a timing event on a side stream, a global-timer stamp kernel between
#              tiny kernels); one GPU is enough; $OUT/timestamp_cost.json; ~1 min
#   spans [CASES]  where an emulated sandbox's iteration goes against its prediction: the suite's CASES (default
#              pipelining-pp2,gpt3d-pp2,fsdp2-2) with the real job recorded and the sandbox's spans timed on the device
#              (PRISM_DEVICE_POINTS=1), benchmarks/sandbox_spans.py of each (real, slice and emulated compute; the
#              schedule's drift), each GPU's clocks sampled; $OUT/fidelity_gpu_spans.json, spans.tgz; ~5 min a case
#   gpu-pace   two GPUs: does the sandbox's GPU set a power-bound job's prediction? ddp-2 (ITERS 30, WARMUP 10) alone
#              on each GPU (N = 1), real at N = 2 and under prism run with the sandbox on GPU 0 and on GPU 1, ROUNDS (2)
#              rounds, each GPU's clocks and power sampled; ~9 min
#   lanecost   two GPUs: the native lane's host time a pruned call (93-101 µs in the suite's TP jobs) against a real
#              call's, and what NCCL's pre-multiplied sum (the lane's small call at N = 2) costs the host by itself:
#              issue_cost.py real with a plain sum and with PREMUL_SUM by 2, fp32 and bf16, then prism run of the plain
#              one (its emulate.json: the lane's calls and their issue time); lanecost.tgz; ~4 min
#   scale      prism run of gpt3d TP2·PP8 at each of WORLDS ranks (1024; "1024 8192 131072") on the GPUs there: wall and
#              host memory by stage, the assistants' RSS and GPU reservation (run_at_scale.py); ~1 min at 1,024, ~4 at 131,072
#   lane-memory  the native lane's peak-memory gap (the distributed optimizer of its GPU test, last rank; LAYOUT="--pp 2":
#              the pipeline's): the
#              peak of plain torchrun, of prism record through the Python recorder (tensors saved: the GPU test's
#              reference) and through the native one, of prism emulate through the Python path and the lane; ~3 min
#   prune-all  pruned latency of every collective kind and send/recv against real 2- and 4-GPU runs (WORLDS, default
#              2,4: four GPUs; OPS: some kinds only), 64 KB - 8 GB (issue 36); writes $OUT/pruning_latency_<gpu>x<gpus>.json;
#              ~100 s at N = 2
#   channels   four GPUs: does a 2-member NCCL group move bytes as fast as a 4-rank one? (a pruned call at N = 4
#              is 11-48 % slower than the real one at 256 MB.) Each real world's channel counts (NCCL_DEBUG), the
#              2-GPU all_reduce / all_gather with NCCL_MIN/MAX_NCHANNELS forced to CHANNELS, then the pruned N = 4
#              sweep with the sandbox's and the proxy's NCCL forced to the 4-rank group's count; ~6 min
#   fidelity-gpu [CASES]  the GPU fidelity suite (benchmarks/fidelity_gpu.py) for DEADLINE s (540); resumes
#              from $OUT/fidelity_gpu.json or benchmarks/results/fidelity_gpu.json (carry the last one back);
#              FID_ARGS: more options, e.g. --concurrent on four GPUs, --record (the real job recorded and solved),
#              --no-issue-thread (prism with PRISM_ISSUE_THREAD=0: the A/B without the issue thread),
#              --prism-devices cuda:0,1 (the sandbox on GPU 0 whatever rank; the default puts it on the GPU the real runs gave its rank);
#              FID_NAME: the results' name (default fidelity_gpu; another keeps an A/B's rows apart);
#              the logs and the graphs (slices', recordings') come back as two tarballs
#   cpu-fid N [CASES]  CPU fidelity rows at N ranks on the host's cores (fair while N <= cores;
#              ~3.5 min a case at N = 8 on 16 cores, so three cases a call: e.g. tp,pp,vpp then
#              dpopt,moe,mixed): merged into $OUT/fidelity_cpu_<cores>c.json (carry the last one
#              back into benchmarks/results/ between calls; FID_JSON=NAME writes NAME.json instead);
#              FID_ARGS replaces the default --noise, e.g. "--repeats 3" (real and emulated runs
#              alternated, medians compared) or "--noise --compute-under-load" (docs/commands/time.md)
#
# Every program started here keeps NVLink multicast off (the device tool's rule), and every
# command has a timeout below the call's limit, so a hang still leaves its logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: device_suite.sh smoke|fid-a|fid-b|overhead|gpu1|native-cost|clock|kernels|ddp-tail|issue-thread|threads|ab-concurrent|numa|gil|hostprof|parts|headstart|hostcost|issue-ab|lane-ab|lane-tests|gpu-tests|timestamps|lane-memory|prune-all|channels|fidelity-gpu|spans|gpu-pace|lanecost|scale|cpu-fid N [CASES]}
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# torch is preinstalled there (python3 may itself be a venv): install prismllm into it, and the carried
# megatron-core wheel (.whl/, `pip download megatron-core==0.19.2 --no-deps --python-version 3.12 -d .whl`)
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
ls .whl/megatron_core-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/megatron_core-*.whl >>"$OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$OUT/gpus.csv" 2>&1

# the parts that measure the Python path's host (its issue thread, its parts): the lane, the default on
# GPUs, issues on the program's thread with no Python on the way; PRISM_NATIVE_LANE=1 runs them on it
case "$PART" in threads|gil|hostprof|parts|hostcost|issue-ab) export PRISM_NATIVE_LANE=${PRISM_NATIVE_LANE:-0} ;; esac

SMALL="--layers 2 --hidden 512 --heads 8 --seq 256 --vocab 4096 --micro-batch 2 --global-batch 8 --iters 6"
# the GPU suite's DDP job (benchmarks/fidelity_gpu.py's ddp-2), which the diagnostic parts below run
P=benchmarks/programs/torch_parallel.py
A="--mode ddp --batch 4 --layers 8 --hidden 2048 --heads 16 --seq 1024 --iters 10"
# median LOG [FIELD] [SKIP]: the median over the steady iterations (all but the first SKIP, default two) of a
# program's log of FIELD ("iter time X ms" by default; "host wait" for its host wait, in %; "period")
median() { grep -h 'iter time' "$1" | tail -n +$((${3:-2} + 1)) | grep -o "${2:-iter time} [0-9.]*" | awk '{print $NF}' \
    | sort -n | awk '{a[NR]=$1} END {print (NR ? a[int((NR + 1) / 2)] : "-")}'; }
# smi FILE: each GPU's SM clock, power and temperature every 100 ms into FILE, in the background (kill $! to stop)
smi() { nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv,noheader -lms 100 >"$1" 2>&1 & }

case "$PART" in
smoke)
    for layout in "--tp 2" "--pp 2"; do
        name=$(echo "$layout" | tr -d ' -')
        d="$OUT/smoke-$name"
        timeout 120 prism capture --mode solo --world 2 --devices cuda:0,1 --layout "${name/2/=2}" --out "$d/bare" \
            -- examples/gpt3d.py $layout $SMALL >"$d.capture.log" 2>&1
        echo "$name capture: $?"
        timeout 150 prism time --graph "$d/bare" --out "$d/time" --devices cuda --inputs generated \
            -- examples/gpt3d.py $layout $SMALL >"$d.time.log" 2>&1
        echo "$name time: $?"
        timeout 20 prism calibrate "$d/time/graph" --out "$d/cal" --write-graph --force >"$d.cal.log" 2>&1
        echo "$name calibrate: $?"
        timeout 120 prism emulate --graph "$d/cal/graph" --sandbox 1 --devices cuda --inputs generated \
            --out "$d/emu" -- examples/gpt3d.py $layout $SMALL >"$d.emu.log" 2>&1
        echo "$name emulate: $?"
        timeout 60 prism record --nproc 2 --out "$d/real" -- examples/gpt3d.py $layout $SMALL >"$d.real.log" 2>&1
        echo "$name record: $?"
        grep -h "median steady\|iteration time" "$d.emu.log" "$d.cal.log" | head -6
        tar czf "$OUT/smoke-$name-logs.tgz" "$d".*.log 2>/dev/null
    done ;;
fid-a)
    timeout 570 python3 benchmarks/fidelity.py --devices cuda --worlds 2 --cases tp,pp --noise \
        --json "$OUT/fidelity_h200x2.json" --timeout 240 2>&1 | tee "$OUT/fid-a.log" | grep -v "^\[" ;;
fid-b)
    [ -f benchmarks/results/fidelity_h200x2.json ] && cp benchmarks/results/fidelity_h200x2.json "$OUT/"
    timeout 570 python3 benchmarks/fidelity.py --devices cuda --worlds 2 --cases vpp,dpopt,moe --noise --merge \
        --json "$OUT/fidelity_h200x2.json" --timeout 240 2>&1 | tee "$OUT/fid-b.log" | grep -v "^\[" ;;
overhead)
    timeout 570 python3 benchmarks/tracing_overhead.py --nproc 2 --layout tp=2 --layout pp=2 --layout dp=2 \
        --rounds 2 --json "$OUT/tracing_overhead_h200x2.json" --md "$OUT/tracing_overhead_h200x2.md" \
        -- --layers 4 --hidden 4096 --heads 32 --seq 1024 --vocab 32000 --micro-batch 1 --global-batch 8 \
        --iters 24 2>&1 | tee "$OUT/overhead.log" | tail -20 ;;
gpu1)
    timeout 420 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_emulate_gpu.py \
        tests/test_recording_gpu.py tests/test_launcher_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15
    for round in 1 2 3; do
        timeout 40 torchrun --nproc-per-node 1 benchmarks/programs/call_cost.py 2>&1 | grep CALLCOST | sed "s/^/plain /"
        TORCH_NCCL_ENABLE_TIMING=1 timeout 40 torchrun --nproc-per-node 1 benchmarks/programs/call_cost.py 2>&1 \
            | grep CALLCOST | sed "s/^/nccl-timing /"
        timeout 60 prism record --nproc 1 --out "/tmp/cc$round" --force -- benchmarks/programs/call_cost.py \
            --breakdown 2>&1 | grep -E "CALLCOST|BREAKDOWN" | sed "s/^/recorded /"
        # BASE=DIR: the same recorded run with an earlier prismllm (a copy of its package in DIR)
        [ -n "${BASE:-}" ] && PYTHONPATH="$BASE" timeout 60 prism record --nproc 1 --out "/tmp/cb$round" --force \
            -- benchmarks/programs/call_cost.py 2>&1 | grep CALLCOST | sed "s/^/recorded-base /"
    done 2>&1 | tee "$OUT/call_cost.log" ;;
native-cost)
    # the native recorder's per-call cost: plain / NCCL timing on / Python path / native (with
    # the recorder's own host time a call, NATIVE_SELF), three rounds
    PRISM_NATIVE_CACHE=/tmp/pnc timeout 200 python3 -c "from prismllm.comm.native import load; load()" \
        >"$OUT/native-build.log" 2>&1 || { echo "native build failed"; tail -20 "$OUT/native-build.log"; exit 1; }
    PRISM_NATIVE=1 PRISM_NATIVE_CACHE=/tmp/pnc timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
        tests/test_recording_gpu.py tests/test_launcher_gpu.py 2>&1 | tail -3 | sed "s/^/pytest-gpu native: /"
    for round in $(seq "${ROUNDS:-3}"); do
        timeout 40 torchrun --nproc-per-node 1 benchmarks/programs/call_cost.py 2>&1 | grep CALLCOST | sed "s/^/plain /"
        TORCH_NCCL_ENABLE_TIMING=1 timeout 40 torchrun --nproc-per-node 1 benchmarks/programs/call_cost.py 2>&1 \
            | grep CALLCOST | sed "s/^/nccl-timing /"
        PRISM_NATIVE=0 timeout 60 prism record --nproc 1 --out "/tmp/cp$round" --force -- \
            benchmarks/programs/call_cost.py 2>&1 | grep CALLCOST | sed "s/^/python /"
        PRISM_NATIVE=1 PRISM_NATIVE_CACHE=/tmp/pnc timeout 60 prism record --nproc 1 --out "/tmp/cn$round" \
            --force -- benchmarks/programs/call_cost.py 2>&1 | grep -E "CALLCOST|NATIVE_SELF" | sed "s/^/native /"
        prism compare "/tmp/cp$round" "/tmp/cn$round" --structure-only 2>&1 | head -3 | sed "s/^/compare python native: /"
    done 2>&1 | tee "$OUT/native_cost.log" ;;
clock)
    timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_replay_clock.py tests/test_emulate_gpu.py \
        2>&1 | tee "$OUT/pytest-gpu.log" | tail -8
    timeout 240 prism run --world 4 --layout tp=1,pp=1 --devices cuda:0,0 --sandbox 3 --out "$OUT/ddp4" --force \
        -- benchmarks/programs/torch_parallel.py --mode ddp --layers 2 --hidden 512 --heads 8 --seq 256 --batch 2 \
        --iters 6 2>&1 | tee "$OUT/ddp4.log" | tail -25
    python3 -c "import json; print(json.dumps(json.load(open('$OUT/ddp4/emulate/emulate.json'))['replay'], indent=1))" \
        2>&1 | tail -40
    tar czf "$OUT/clock-logs.tgz" "$OUT/ddp4/logs" "$OUT/ddp4/emulate/emulate.json" 2>/dev/null ;;
kernels)
    # a DDP job's sandbox rank, kernel by kernel: the real run, its slice and its emulation under the
    # PyTorch profiler (benchmarks/programs/profile_rank.py, PROFILE_WITH=kineto), summarised by
    # benchmarks/kernel_timeline.py; the emulation once more under cProfile (host time); the real job recorded (prism record) for a
    # span-by-span comparison with the slice's timed graph. N = 2 and N = 4 (four GPUs; prism on two)
    K=benchmarks/programs/profile_rank.py D=out/kernels/logs W=out/kernels
    mkdir -p "$D" "$W"
    for n in ${WORLDS:-2 4}; do
        r=$((n - 1)) w="$W/ddp$n" pk="PRISM_PROGRAM_CHECK=off PROFILE_WITH=kineto PROFILE_RANK=all PROFILE_OUT=$D"
        timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" $P $A >"$D/real$n.log" 2>&1; echo "real $n: $?"
        env PROFILE_WITH=kineto PROFILE_RANK=$r PROFILE_OUT="$D" PROFILE_TAG="real$n" timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
            $K $P $A >"$D/real${n}k.log" 2>&1; echo "real $n kineto: $?"
        timeout 200 prism run --world "$n" --layout tp=1,pp=1 --devices cuda:0,1 --sandbox $r --out "$w" --force -- $P $A \
            >"$D/prism$n.log" 2>&1; echo "prism run $n: $?"
        env $pk PROFILE_TAG="slice$n" timeout 150 prism time --graph "$w/bare" --out "$w/time-k" --devices cuda:0,1 --force \
            -- $K $P $A >"$D/slice${n}k.log" 2>&1; echo "slice $n kineto: $?"
        env $pk PROFILE_TAG="emu$n" timeout 150 prism emulate --graph "$w/cal/graph" --sandbox $r --devices cuda:0,1 \
            --out "$w/emu-k" --force -- $K $P $A >"$D/emu${n}k.log" 2>&1; echo "emulate $n kineto: $?"
        env PRISM_PROGRAM_CHECK=off PROFILE_RANK=$r PROFILE_OUT="$D/cprof$n" timeout 150 prism emulate --graph "$w/cal/graph" \
            --sandbox $r --devices cuda:0,1 --out "$w/emu-p" --force -- $K $P $A \
            >"$D/emu${n}p.log" 2>&1; echo "emulate $n cProfile: $?"
        [ "$n" = 2 ] && { timeout 150 prism record --nproc 2 --devices cuda:0,1 --out "$w/rec" --force -- $P $A \
            >"$D/rec$n.log" 2>&1; echo "record $n: $?"; }
        python3 benchmarks/kernel_timeline.py "$D"/rank*-*"$n".json.gz --json "$D/kernels$n.json" 2>&1 | tail -5
    done
    tar czf "$OUT/kernel-traces.tgz" "$D"/*.json.gz 2>/dev/null
    tar czf "$OUT/kernel-logs.tgz" "$D"/*.log "$D"/*.json "$D"/cprof* 2>/dev/null
    tar czf "$OUT/kernel-graphs.tgz" "$W"/*/time/graph "$W"/*/time-k/graph "$W"/*/rec/graph "$W"/*/cal/summary.json \
        "$W"/*/emu*/emulate.json 2>/dev/null
    ls -la "$OUT" ;;
ddp-tail)
    # TAIL_NAME/TAIL_PROGRAM/TAIL_ARGS/TAIL_LAYOUT: another job than the suite's ddp-2 (e.g. gpt3d-pp2);
    # TAIL_DEVICES: prism's (default cuda:0,1; cuda:1,0 puts the sandbox on the GPU the real rank 1 ran on)
    K=benchmarks/programs/profile_rank.py N=${TAIL_NAME:-ddp-2} PROG=${TAIL_PROGRAM:-$P} LAY=${TAIL_LAYOUT:-tp=1,pp=1}
    TD=${TAIL_DEVICES:-cuda:0,1}
    B=${TAIL_ARGS:---mode ddp --batch 16 --layers 8 --hidden 2048 --heads 16 --seq 1024 --iters 10}
    D=out/ddp-tail/$N W=out/ddp-tail/$N/w
    mkdir -p "$D"
    # each GPU's clocks and power while each run goes (is a slice's GPU faster because it runs cooler or
    # under less power than a real run's?)
    smi "$D/smi-real.csv"; s=$!
    env PROFILE_WITH=kineto PROFILE_RANK=1 PROFILE_OUT="$D" PROFILE_TAG=real timeout 120 python3 -m torch.distributed.run \
        --standalone --nproc-per-node 2 $K $PROG $B >"$D/real.log" 2>&1; echo "real kineto: $?"; kill $s
    timeout 200 prism run --world 2 --layout "$LAY" --devices "$TD" --sandbox 1 --out "$W" --force -- $PROG $B \
        >"$D/prism.log" 2>&1; echo "prism run: $?"
    # which processes hold which GPU while the slice and the emulation run (a second context on the
    # sandbox's GPU time-slices it: on one shared GPU the slice's AdamW kernels ran 15.2 ms against 6.8)
    nvidia-smi --query-compute-apps=timestamp,pid,process_name,gpu_bus_id,used_memory --format=csv -l 2 \
        >"$D/apps.csv" 2>&1 &
    apps=$!
    for what in slice emu; do
        if [ $what = slice ]; then cmd=(time --graph "$W/bare" --out "$W/time-k"); else
            cmd=(emulate --graph "$W/cal/graph" --sandbox 1 --out "$W/emu-k"); fi
        smi "$D/smi-$what.csv"; s=$!
        env PRISM_PROGRAM_CHECK=off PROFILE_WITH=kineto PROFILE_RANK=all PROFILE_OUT="$D" PROFILE_TAG=$what timeout 150 \
            prism "${cmd[@]}" --devices "$TD" --force -- $K $PROG $B >"$D/$what.log" 2>&1; echo "$what kineto: $?"
        kill $s
    done
    kill $apps 2>/dev/null
    nvidia-smi --query-gpu=index,pci.bus_id --format=csv >>"$D/apps.csv" 2>&1
    python3 benchmarks/kernel_timeline.py "$D"/rank*.json.gz --json "$D/kernels.json" 2>&1 | cut -c1-1500
    grep -h "iter time" "$D/real.log" "$D/emu.log" | tail -4
    tar czf "$OUT/tail-$N.tgz" "$D"/*.log "$D"/*.csv "$D"/*.json "$W"/time-k/graph "$W"/cal/summary.json 2>/dev/null ;;
issue-thread)
    # the issue thread (the default) on two GPUs (four for the real DDP run beside it): the GPU tests of the
    # pruned all_reduce and of a DP2 emulation's values, a DDP job's prism run beside its real run (GPUs 2, 3),
    # the host's cost of an async call real and emulated; ~4 min
    # (faulthandler_timeout: a test still running after 120 s prints every thread's stack to the log)
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=120 tests/test_pruned_nccl_gpu.py \
        "tests/test_emulate_gpu.py::test_losses_and_pruned_outputs_equal_the_real_run[dp2_distopt]" \
        >"$OUT/issue-thread-tests.log" 2>&1
    tail -5 "$OUT/issue-thread-tests.log"
    L=out/thread/logs
    mkdir -p "$L"
    CUDA_VISIBLE_DEVICES=2,3 timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P $A \
        >"$L/ddp2-real.log" 2>&1 &
    timeout 150 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out out/thread/ddp2 --force \
        -- $P $A >"$L/ddp2-prism.log" 2>&1
    wait
    cp out/thread/ddp2/logs/emulate.log "$L/ddp2-emulate.log" 2>/dev/null
    grep -h "iteration 10/\|predicted iteration\|emulated, rank" "$L"/ddp2-*.log
    # one tarball: files back from $OUT are at most 8
    tar czf "$OUT/thread.tgz" "$L" out/thread/ddp2/time/graph out/thread/ddp2/cal/summary.json \
        out/thread/ddp2/emulate/emulate.json 2>/dev/null
    WORLDS=2 timeout 100 bash benchmarks/device_suite.sh hostcost 2>&1 | tee "$OUT/hostcost.log" | grep -h "^ISSUE" ;;
threads)
    K=benchmarks/programs/profile_rank.py D=out/threads/logs W=out/threads/ddp2
    mkdir -p "$D"
    env PROFILE_WITH=threads PROFILE_RANK=1 PROFILE_OUT="$D" PROFILE_TAG=real2 timeout 120 python3 -m torch.distributed.run \
        --standalone --nproc-per-node 2 $K $P $A >"$D/real2.log" 2>&1; echo "real: $?"
    timeout 200 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out "$W" --force -- $P $A \
        >"$D/prism2.log" 2>&1; echo "prism run: $?"
    pt="PRISM_PROGRAM_CHECK=off PROFILE_WITH=threads PROFILE_RANK=all PROFILE_OUT=$D"
    env $pt PROFILE_TAG=slice2 timeout 150 prism time --graph "$W/bare" --out "$W/time-t" --devices cuda:0,1 --force \
        -- $K $P $A >"$D/slice2.log" 2>&1; echo "slice: $?"
    env $pt PROFILE_TAG=emu2 timeout 150 prism emulate --graph "$W/cal/graph" --sandbox 1 --devices cuda:0,1 \
        --out "$W/emu-t" --force -- $K $P $A >"$D/emu2.log" 2>&1; echo "emulate: $?"
    for f in "$D"/*-threads.json; do
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], 'cpus', len(d['usable_cpus'])); \
[print(f\"  {t['name']:18s} cpu {t['cpu_s']:7.2f} s  vol {t['voluntary_switches']:8d}  invol {t['involuntary_switches']:7d}\") \
 for t in sorted(d['threads'], key=lambda t: -t['cpu_s'])[:8]]" "$f"
    done
    tar czf "$OUT/threads.tgz" "$D" "$W"/time-t/graph 2>/dev/null ;;
ab-concurrent)
    for round in $(seq "${ROUNDS:-2}"); do
        for mode in conc seq; do
            extra=""; [ "$mode" = conc ] && extra="--concurrent"
            timeout 230 python3 benchmarks/fidelity_gpu.py --cases ddp-2 --reals 2 $extra --json "$OUT/ab-$mode$round.json" \
                --md "out/ab/$mode$round.md" --work "out/ab/$mode$round" 2>&1 | grep "^\[ddp-2\] prism run:\|real run [0-9]:"
        done
    done
    tar czf "$OUT/ab-logs.tgz" out/ab/*/*/*.log out/ab/*/*/prism/time/graph 2>/dev/null ;;
numa)
    # does where the host threads run move a DDP job's time? The machine's topology (each GPU's CPU and
    # NUMA affinity), then ddp-2 real and under prism run, each unpinned and pinned to GPU 0's NUMA node's
    # CPUs (taskset, inherited by every child), alternated; ~4 min
    D=out/numa
    mkdir -p "$D"
    nvidia-smi topo -m | tee "$D/topo.txt"
    lscpu | grep -i "numa\|model name\|mhz" | tee "$D/lscpu.txt"
    cpus=$(nvidia-smi topo -m | awk '$1 == "GPU0" {for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$/ && $i ~ /-/) {print $i; exit}}')
    [ -z "$cpus" ] && cpus=$(lscpu | awk -F: '/NUMA node0 CPU/ {gsub(/ /, "", $2); print $2}')
    echo "GPU0 CPU affinity: ${cpus:-unknown}"
    for round in 1 2; do
        for pin in none node; do
            run=""; [ "$pin" = node ] && [ -n "$cpus" ] && run="taskset -c $cpus"
            $run timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P $A >"$D/real-$pin$round.log" 2>&1
            $run timeout 150 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out "$D/prism-$pin$round" \
                --force -- $P $A >"$D/prism-$pin$round.log" 2>&1
            echo "$pin $round: real median $(median "$D/real-$pin$round.log") ms |" \
                "$(grep -h 'predicted iteration\|emulated, rank' "$D/prism-$pin$round.log" | tr -s ' ' | tr '\n' ' ')"
        done
    done
    tar czf "$OUT/numa.tgz" "$D"/*.log "$D"/*.txt "$D"/prism-*/logs "$D"/prism-*/time/graph 2>/dev/null ;;
gil)
    # a DDP job's slice and emulation, alternated over ROUNDS (2) rounds, three ways: the issue thread (the
    # default), without it (PRISM_ISSUE_THREAD=0), and the issue thread with Python's GIL switch interval at
    # 50 us (a sitecustomize on PYTHONPATH: every Python process of the run); each slice's and emulation's
    # host threads' CPU time and context switches (profile_rank.py threads); the real job under prism record
    # and plain, twice each. Is the slices' run-to-run spread (one lease: 37.5 to 47.2 ms) the program's
    # threads waiting for the GIL? ~7 min
    K=benchmarks/programs/profile_rank.py D=out/gil W=out/gil/ddp2
    mkdir -p "$D/sw"
    printf 'import sys\nsys.setswitchinterval(5e-5)\n' >"$D/sw/sitecustomize.py"
    echo "switch interval with the sitecustomize: $(PYTHONPATH=$PWD/$D/sw python3 -c 'import sys; print(sys.getswitchinterval())')"
    timeout 150 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out "$W" --force -- $P $A \
        >"$D/prism.log" 2>&1; echo "prism run: $? $(grep -h 'predicted iteration\|emulated, rank' "$D/prism.log" | tr -s ' ' | tr '\n' ' ')"
    for round in $(seq "${ROUNDS:-2}"); do
        for v in t1 t0 sw; do
            env=""; [ "$v" = t0 ] && env="PRISM_ISSUE_THREAD=0"; [ "$v" = sw ] && env="PYTHONPATH=$PWD/$D/sw"
            pt="PRISM_PROGRAM_CHECK=off PROFILE_WITH=threads PROFILE_RANK=all PROFILE_OUT=$D/threads"
            env $env $pt PROFILE_TAG="slice-$v$round" timeout 100 prism time --graph "$W/bare" --out "$D/time-$v$round" \
                --devices cuda:0,1 --force -- $K $P $A >"$D/time-$v$round.log" 2>&1
            timeout 30 prism calibrate "$D/time-$v$round/graph" --out "$D/cal-$v$round" --force >/dev/null 2>&1
            env $env $pt PROFILE_TAG="emu-$v$round" timeout 100 prism emulate --graph "$W/cal/graph" --sandbox 1 \
                --devices cuda:0,1 --out "$D/emu-$v$round" --force -- $K $P $A >"$D/emu-$v$round.log" 2>&1
            pred=$(python3 -c "import json; print(json.load(open('$D/cal-$v$round/summary.json'))['predicted_iteration_ns'] / 1e6)" 2>&1 | tail -1)
            echo "$v $round: slice $pred ms | emulated $(median "$D/emu-$v$round.log") ms"
        done
    done
    for round in 1 2; do
        timeout 90 prism record --nproc 2 --devices cuda:0,1 --out "$D/rec$round" --force -- $P $A >"$D/rec$round.log" 2>&1
        timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P $A >"$D/real$round.log" 2>&1
        echo "record $round: $(median "$D/rec$round.log") ms | real $round: $(median "$D/real$round.log") ms"
    done
    for f in "$D"/threads/*-threads.json; do
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); t=sorted(d['threads'], key=lambda t: -t['voluntary_switches'])[:3]; \
print(sys.argv[1].split('/')[-1], ' '.join(f\"{x['name']}:{x['cpu_s']:.2f}s/{x['voluntary_switches']}v/{x['involuntary_switches']}i\" for x in t))" "$f"
    done
    tar czf "$OUT/gil.tgz" "$D"/*.log "$D"/threads "$D"/time-*/graph "$D"/cal-*/summary.json "$D"/emu-*/emulate.json "$D"/rec*/graph 2>/dev/null ;;
hostprof)
    # where a DDP rank's host time goes, the real job's against the emulated sandbox's, on one machine: the
    # CPU topology; py-spy (every thread, native frames, 200 samples a second) over 2 s of steady iterations
    # on the real job's reporting rank and on the emulated sandbox, each of their threads' CPU time and CPU
    # over that window, every busy thread of the machine (top); needs .whl/py_spy-*.whl (pip download
    # py-spy --no-deps -d .whl); ~3 min (lease 17: one thread a core, so no pinning to try)
    D=out/hostprof W=out/hostprof/ddp2
    mkdir -p "$D"
    python3 -m pip install -q --no-deps .whl/py_spy-*.whl >>"$OUT/install.log" 2>&1 || echo "py-spy: not installed"
    { lscpu; lscpu -p=CPU,CORE,SOCKET,NODE; } >"$D/lscpu.txt" 2>&1
    grep -E "^(Thread|Core|Socket|NUMA node\(s\)|Model name|CPU\(s\))" "$D/lscpu.txt"
    LONG="$A --iters 60"  # the last --iters wins: ~2.5 s of steady iterations
    # rank1: the pid of the program's process whose environment has RANK=1 (neither a launcher nor the assistant)
    rank1() { for p in $(pgrep -f torch_parallel.py); do tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx RANK=1 \
        && ! tr '\0' ' ' <"/proc/$p/cmdline" | grep -q "assistant\|torch.distributed.run\|prismllm.cli" && echo "$p" && return; done; }
    # threadcpu PID: each thread's name, CPU ticks (user + system) and the CPU it ran on last, one line
    threadcpu() { for t in /proc/$1/task/*; do awk '{sub(/^[0-9]+ \(/, ""); n = $0; sub(/\).*/, "", n); sub(/^[^)]*\) /, "");
        printf "%s|%d|%d ", n, $12 + $13, $37}' "$t/stat" 2>/dev/null; done; echo; }
    # sample TAG LOG: once LOG shows the 4th iteration, 2 s of py-spy on the rank-1 process
    sample() {
        for _ in $(seq 900); do grep -q "iteration 4/" "$2" 2>/dev/null && break; sleep 0.1; done
        pid=$(rank1)
        [ -z "$pid" ] && { echo "$1: no rank-1 process"; ps -eo pid,args | grep -v grep | grep torch_parallel | cut -c1-200; return; }
        threadcpu "$pid" >"$D/$1-threads-before.txt"
        top -H -b -n 2 -d 1 -w 200 >"$D/$1-top.txt" 2>&1 &
        timeout 20 py-spy record --pid "$pid" --threads --native --idle --rate 200 --duration 2 \
            --format raw --output "$D/$1.pyspy.txt" >"$D/$1.pyspy.log" 2>&1
        threadcpu "$pid" >"$D/$1-threads-after.txt"
        wait
        echo "$1: pid $pid, $(wc -l <"$D/$1.pyspy.txt" 2>/dev/null) stacks"
    }
    timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P $LONG >"$D/real.log" 2>&1 &
    sample real "$D/real.log"; wait
    timeout 200 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out "$W" --force -- $P $LONG \
        >"$D/prism.log" 2>&1; echo "prism run: $? $(grep -h 'predicted iteration\|emulated, rank' "$D/prism.log" | tr -s ' ' | tr '\n' ' ')"
    timeout 120 prism emulate --graph "$W/cal/graph" --sandbox 1 --devices cuda:0,1 --out "$D/emu" --force -- $P $LONG \
        >"$D/emu.log" 2>&1 &
    sample emu "$D/emu.log"; wait
    echo "real (py-spy) $(median "$D/real.log") ms | emulated (py-spy) $(median "$D/emu.log") ms"
    tar czf "$OUT/hostprof.tgz" "$D"/*.txt "$D"/*.log "$W"/time/graph "$W"/logs "$D"/emu/emulate.json 2>/dev/null ;;
parts)
    # the emulation layer's host time by part (emulation_host_parts: wall and CPU a call) on the suite's DDP job
    # at 60 iterations, in its slice and its emulation; every busy thread of the machine (top) while the
    # emulation iterates (does an assistant thread still spin?); first the assistant's and the head start's GPU
    # tests; ~6 min
    D=out/parts W=out/parts/ddp2
    mkdir -p "$D"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_assistant_gpu.py tests/test_headstart_gpu.py \
        2>&1 | tail -3
    LONG="$A --iters 60"  # the last --iters wins
    timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P $LONG >"$D/real.log" 2>&1
    echo "real: $(median "$D/real.log") ms"
    timeout 300 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out "$W" --force -- $P $LONG \
        >"$D/prism.log" 2>&1 &
    for _ in $(seq 2400); do grep -q "iteration 20/" "$W/logs/emulate.log" 2>/dev/null && break; sleep 0.1; done
    top -H -b -n 2 -d 1 -w 200 | awk '/^top -/ {n++} n == 2' | head -20 >"$D/top.txt"
    wait
    grep -h 'predicted iteration\|emulated, rank' "$D/prism.log"
    python3 - "$W" <<'PY'
import json, sys

w = sys.argv[1]


def show(what, parts):
    for part, (calls, wall, cpu) in sorted(parts.items(), key=lambda kv: -kv[1][1]):
        print(f"{what:12s} {part:15s} {calls:6d} calls {wall / calls / 1e3:9.1f} us wall {cpu / calls / 1e3:9.1f} us CPU")


timed = json.load(open(f"{w}/time/graph/manifest.json"))["timing"]
for r, parts in (timed.get("emulation_host_parts") or {}).items():
    show(f"slice {r}", parts)
for r, res in json.load(open(f"{w}/emulate/emulate.json"))["sandbox_results"].items():
    show(f"emulated {r}", res.get("emulation_host_parts") or {})
PY
    cat "$D/top.txt"
    tar czf "$OUT/parts.tgz" "$D"/*.log "$D"/*.txt "$W"/time/graph "$W"/logs "$W"/emulate/emulate.json 2>/dev/null ;;
headstart)
    # the host's head start of GPU slices (comm.headstart): a DDP job's prism run (the default head start,
    # "overhead"), its slice again with each head start, the real job; then the head start's GPU test; ~5 min
    D=out/hs W=out/hs/ddp2
    mkdir -p "$D"
    timeout 150 prism run --world 2 --layout tp=1,pp=1 --devices cuda:0,1 --sandbox 1 --out "$W" --force -- $P $A \
        >"$D/prism.log" 2>&1; echo "prism run: $? $(grep -h 'predicted iteration\|emulated, rank' "$D/prism.log" | tr -s ' ' | tr '\n' ' ')"
    grep -h "head start" "$D/prism.log" | head -3
    for v in ${MODES:-iteration off overhead}; do
        timeout 100 prism time --graph "$W/bare" --out "$D/time-$v" --devices cuda:0,1 --force --head-start "$v" -- $P $A \
            >"$D/time-$v.log" 2>&1
        timeout 30 prism calibrate "$D/time-$v/graph" --out "$D/cal-$v" --force >/dev/null 2>&1
        echo "$v: slice $(python3 -c "import json; print(json.load(open('$D/cal-$v/summary.json'))['predicted_iteration_ns'] / 1e6)" 2>&1 | tail -1) ms" \
            "$(python3 -c "import json; print(json.load(open('$D/time-$v/graph/manifest.json'))['timing'].get('head_start'))" 2>&1 | tail -1)"
    done
    timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P $A >"$D/real.log" 2>&1
    echo "real: $(median "$D/real.log") ms"
    tar czf "$OUT/hs.tgz" "$D"/*.log "$D"/time-*/graph "$D"/cal-*/summary.json "$W"/logs "$W"/time/graph "$W"/cal/summary.json \
        "$W"/emulate/emulate.json 2>/dev/null
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_headstart_gpu.py >"$D/test.log" 2>&1
    echo "head start GPU test: $(tail -1 "$D/test.log")"; grep -h "^E " "$D/test.log" | head -5
    tar czf "$OUT/hs-test.tgz" "$D/test.log" 2>/dev/null ;;
hostcost)
    # the host's cost of issuing an async collective (benchmarks/programs/issue_cost.py), real (torchrun) and
    # emulated (prism run, sandbox on GPU 0, assistant on GPU 1) at N = 2 and 4; the emulation's host under cProfile
    P=benchmarks/programs/issue_cost.py D=out/hostcost/logs W=out/hostcost
    mkdir -p "$D" "$W"
    for n in ${WORLDS:-2 4}; do
        r=$((n - 1))
        timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" $P >"$D/real$n.log" 2>&1
        timeout 200 prism run --world "$n" --devices cuda:0,1 --sandbox $r --out "$W/n$n" --force -- $P >"$D/prism$n.log" 2>&1
        cp "$W/n$n/logs/emulate.log" "$D/emu$n.log" 2>/dev/null
        env PRISM_PROGRAM_CHECK=off PROFILE_RANK=$r PROFILE_OUT="$D/cprof$n" timeout 120 prism emulate --graph "$W/n$n/cal/graph" \
            --sandbox $r --devices cuda:0,1 --out "$W/n$n/emu-p" --force -- benchmarks/programs/profile_rank.py $P \
            >"$D/emu${n}p.log" 2>&1
        echo "N=$n real / emulated / emulated under cProfile:"; grep -h "^ISSUE" "$D/real$n.log" "$D/emu$n.log" "$D/emu${n}p.log"
        # each call cold, as DDP's buckets come between backward launches (--between-us): real, then the emulation
        # with the issue thread and without
        timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" $P --between-us 300 \
            >"$D/real${n}c.log" 2>&1
        for v in 1 0; do
            PRISM_ISSUE_THREAD=$v timeout 120 prism emulate --graph "$W/n$n/cal/graph" --sandbox $r --devices cuda:0,1 \
                --out "$W/n$n/emu-c$v" --force -- $P --between-us 300 >"$D/emu${n}c$v.log" 2>&1
        done
        echo "N=$n cold calls: real / emulated (issue thread) / emulated (none):"
        grep -h "^ISSUE" "$D/real${n}c.log" "$D/emu${n}c1.log" "$D/emu${n}c0.log"
    done
    tar czf "$OUT/hostcost.tgz" "$D" ;;  # (files back from $OUT: at most 8)
issue-ab|lane-ab)
    D=out/$PART
    mkdir -p "$D"
    # the setting switched: the issue thread, or the native lane (whose GPU tests then run with it on)
    V=PRISM_ISSUE_THREAD; [ "$PART" = lane-ab ] && V=PRISM_NATIVE_LANE
    [ "${TESTS:-1}" = 1 ] && { env "$V=1" timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pruned_nccl_gpu.py \
        tests/test_emulate_gpu.py -k "nccl or tp2 or dp2_distopt" >"$D/pytest.log" 2>&1
        echo "GPU tests: $(tail -1 "$D/pytest.log")"; grep -h "^E " "$D/pytest.log" | head -5; }
    for n in ${WORLDS:-2 4}; do
        r=$((n - 1)) W="$D/ddp$n"
        timeout 200 prism run --world "$n" --layout tp=1,pp=1 --devices cuda:0,1 --sandbox $r --out "$W" --force -- $P $A \
            >"$D/prism$n.log" 2>&1; echo "N=$n prism run: $? $(grep -h 'predicted iteration\|emulated, rank' "$D/prism$n.log" | tr -s ' ' | tr '\n' ' ')"
        for round in $(seq "${ROUNDS:-3}"); do
            for v in 1 0; do
                e="$D/emu$n-t$v-$round"
                env "$V=$v" timeout 120 prism emulate --graph "$W/cal/graph" --sandbox $r --devices cuda:0,1 \
                    --out "$e" --force -- $P $A >"$e.log" 2>&1
                echo "N=$n $V=$v round $round: emulated $(median "$e.log") ms, host wait $(median "$e.log" 'host wait') %"
                python3 -c "import json, sys; res = json.load(open(sys.argv[1]))['sandbox_results'][sys.argv[2]]; \
print('   ', ' | '.join(f'{k} {w / c / 1e3:.0f}/{u / c / 1e3:.0f} us' for k, (c, w, u) in sorted(res.get('emulation_host_parts', {}).items())), \
res.get('emulation_native_lane') or '')" "$e/emulate.json" "$r" 2>&1 | tail -1
            done
        done
        for i in 1 2; do
            timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" $P $A >"$D/real$n-$i.log" 2>&1
            echo "N=$n real $i: $(median "$D/real$n-$i.log") ms, host wait $(median "$D/real$n-$i.log" 'host wait') %"
        done
    done
    tar czf "$OUT/$PART.tgz" "$D"/*.log "$D"/emu*/emulate.json "$D"/ddp*/cal/summary.json "$D"/ddp*/logs 2>/dev/null ;;
lane-tests)
    # the native lane's GPU tests alone (losses and peak memory of TP2, PP2, the distributed optimizer), every
    # failure's whole message in $OUT/lane-tests.log
    PRISM_NATIVE_LANE=1 timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
        tests/test_emulate_gpu.py -k native_lane >"$OUT/lane-tests.log" 2>&1
    echo "lane GPU tests: $(tail -1 "$OUT/lane-tests.log")"; grep -h "^E " "$OUT/lane-tests.log" | head -20 ;;
gpu-tests)
    # every GPU-marked test file on its own, each with its own timeout and log ($OUT/gpu-<file>.log, every result
    # and failure message in it): a file that hangs costs its own timeout and leaves the others' results
    # FILES: the test files (default: every one with GPU tests); PER: seconds a file (180)
    for f in ${FILES:-$(grep -l "pytest.mark.gpu" tests/test_*.py)}; do
        name=$(basename "$f" .py)
        timeout "${PER:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA "$f" >"$OUT/gpu-$name.log" 2>&1
        echo "$name: rc $? $(tail -1 "$OUT/gpu-$name.log")"; grep -h "^E " "$OUT/gpu-$name.log" | head -5
    done ;;
timestamps)
    timeout 240 python3 benchmarks/programs/timestamp_cost.py --json "$OUT/timestamp_cost.json" 2>&1 | tail -30 ;;
lane-memory)
    D=out/lane-memory
    rm -rf "$D"; mkdir -p "$D"
    # LAYOUT: the GPU test's layout arguments (default the distributed optimizer's; e.g. "--pp 2")
    G="${LAYOUT:---dist-opt} --layers 2 --hidden 32 --heads 4 --seq 16 --vocab 128 --micro-batch 1 --global-batch 4 --iters 3"
    # peak LABEL JSON-LOG: the last rank's torch.cuda.max_memory_allocated after its last iteration, as gpt3d logs it
    peak() { python3 -c "import json, sys; print(f'{sys.argv[1]:28s} program {json.load(open(sys.argv[2]))[-1][\"max_mem_bytes\"]:,} B')" "$1" "$2" 2>&1 | tail -1; }
    timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/gpt3d.py $G --json-log "$D/plain.json" \
        >"$D/plain.log" 2>&1; peak "plain torchrun" "$D/plain.json"
    for rec in python native; do
        extra=""; [ $rec = python ] && extra="--save-tensors all,inputs"
        timeout 120 prism record --nproc 2 --devices cuda:0,1 --recorder $rec $extra --out "$D/rec-$rec" -- examples/gpt3d.py $G \
            --json-log "$D/rec-$rec.json" >"$D/rec-$rec.log" 2>&1; peak "prism record ($rec)" "$D/rec-$rec.json"
        python3 -c "import json, sys; print('   manifest', json.load(open(sys.argv[1]))['peak_memory_bytes'])" "$D/rec-$rec/manifest.json" 2>&1 | tail -1
    done
    for lane in 0 1; do
        PRISM_NATIVE_LANE=$lane timeout 120 prism emulate --graph "$D/rec-python" --sandbox 1 --devices cuda:0,1 --out "$D/emu$lane" \
            -- examples/gpt3d.py $G --json-log "$D/emu$lane.json" >"$D/emu$lane.log" 2>&1; peak "prism emulate (lane $lane)" "$D/emu$lane.json"
        python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['sandbox_results']['1']; \
print('   emulate.json', r['peak_memory_bytes'], 'scratch', r['emulation_scratch_bytes'], r.get('emulation_native_lane'))" "$D/emu$lane/emulate.json" 2>&1 | tail -1
    done
    tar czf "$OUT/lane-memory.tgz" "$D"/*.log "$D"/*.json "$D"/emu*/emulate.json 2>/dev/null ;;
prune-all)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr 'H' 'h')
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
    # WORLDS: the logical world sizes (default 2,4: real N = 4 needs four GPUs)
    timeout "${PRUNE_TIMEOUT:-580}" python3 benchmarks/pruning_latency.py --devices cuda --worlds "${WORLDS:-2,4}" \
        --rounds "${ROUNDS:-1}" ${OPS:+--ops "$OPS"} --json "$OUT/pruning_latency_${gpu}x${gpus}.json" --timeout 240 2>&1 \
        | tee "$OUT/prune-all.log" | tail -70 ;;
channels)
    D=out/channels C=benchmarks/programs/collective_sizes.py S=${SIZES:-64KB,16MB,256MB,1GB}
    mkdir -p "$D"
    # each timed call of collective_sizes.py's LOG: op, bytes, median µs
    timed() { grep -h '^COLLECTIVE ' "$1" | python3 -c "import json,sys; [print(' ', d['op'], d['bytes'], d['median_us'])
        for d in (json.loads(l.split(' ', 1)[1]) for l in sys.stdin)]"; }
    for n in 2 4; do
        NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING timeout 120 python3 -m torch.distributed.run --standalone \
            --nproc-per-node "$n" $C --ops all_reduce,all_gather --sizes "$S" --ahead 50 >"$D/real$n.log" 2>&1
        echo "N=$n: $(grep -m1 -o '[0-9]* coll channels.*' "$D/real$n.log")"
        timed "$D/real$n.log"
    done
    four=$(grep -m1 -o '[0-9]* coll channels' "$D/real4.log" | grep -o '^[0-9]*')
    for ch in ${CHANNELS:-16 24 32} $four; do
        NCCL_MIN_NCHANNELS=$ch NCCL_MAX_NCHANNELS=$ch timeout 90 python3 -m torch.distributed.run --standalone \
            --nproc-per-node 2 $C --ops all_reduce,all_gather --sizes "$S" --ahead 50 >"$D/real2-ch$ch.log" 2>&1
        echo "N=2, $ch channels forced:"; timed "$D/real2-ch$ch.log"
    done
    # the pruned sweep at N = 4, every NCCL group of the run (the real 4-rank one too) at the 4-rank count
    [ -n "$four" ] && NCCL_MIN_NCHANNELS=$four NCCL_MAX_NCHANNELS=$four timeout 300 python3 benchmarks/pruning_latency.py \
        --devices cuda --worlds 4 --ops all_reduce,all_gather,reduce_scatter --sizes "$S" --rounds 1 \
        --json "$OUT/pruning_latency_channels$four.json" --timeout 200 2>&1 | grep -E '^\| 4 \|'
    tar czf "$OUT/channels-logs.tgz" "$D" ;;
fidelity-gpu)
    J=${FID_NAME:-fidelity_gpu}  # another name keeps an A/B's rows apart from the suite's
    [ -f "$OUT/$J.json" ] || cp "benchmarks/results/$J.json" "$OUT/" 2>/dev/null
    timeout $((${DEADLINE:-540} + 45)) python3 benchmarks/fidelity_gpu.py --cases "${2:-all}" --json "$OUT/$J.json" \
        --work out/fidelity_gpu --deadline "${DEADLINE:-540}" ${FID_ARGS:-} 2>&1 | tee "$OUT/fidelity-gpu.log" | tail -40
    tar czf "$OUT/fidelity-logs.tgz" out/fidelity_gpu/*/*.log out/fidelity_gpu/*/prism/logs \
        out/fidelity_gpu/*/prism/emulate/emulate.json out/fidelity_gpu/*/prism/run.json 2>/dev/null
    # the slices' timed graphs and the real recordings' graphs, to compare span by span
    tar czf "$OUT/fidelity-graphs.tgz" out/fidelity_gpu/*/prism/time/graph out/fidelity_gpu/*/prism/cal/summary.json \
        out/fidelity_gpu/*/record/*.parquet out/fidelity_gpu/*/record/manifest.json out/fidelity_gpu/*/record-cal/summary.json \
        out/fidelity_gpu/*/prism/emulate/ranklogs 2>/dev/null ;;
spans)
    # where the emulated sandbox's iteration goes against its prediction: the suite's CASES (default
    # pipelining-pp2,gpt3d-pp2,fsdp2-2) with the real job recorded and the sandbox's spans on the device
    # (fidelity_gpu.py --record --device-points: each row's prism.spans, per span in spans.json), each GPU's
    # clocks and power sampled all along; the spans, the schedules and the samples in $OUT/spans.tgz
    mkdir -p out/fidelity_gpu; smi out/fidelity_gpu/smi-spans.csv; s=$!
    FID_NAME=${FID_NAME:-fidelity_gpu_spans} FID_ARGS="--record --device-points ${FID_ARGS:-}" \
        bash "$0" fidelity-gpu "${2:-pipelining-pp2,gpt3d-pp2,fsdp2-2}"
    kill $s
    tar czf "$OUT/spans.tgz" out/fidelity_gpu/smi-spans.csv out/fidelity_gpu/*/spans.json out/fidelity_gpu/*/spans.log \
        out/fidelity_gpu/*/prism/emulate/schedule.parquet 2>/dev/null ;;
gpu-pace)
    # does the sandbox's GPU set a power-bound job's prediction? The suite's ddp-2 (it runs into the H200's power
    # limit) with ITERS (30) iterations, the first WARMUP (10) left out (its real periods rose 96 -> 100 ms over
    # ten): the job alone on each GPU (N = 1, no NCCL), the real N = 2 job, and prism run with the sandbox on GPU 0
    # and on GPU 1, ROUNDS (2) rounds alternated; each GPU's SM clock, power and temperature every 100 ms during
    # every run (smi-<run>.csv); the results (fidelity_gpu_pace_<devices>_<round>.json), logs and samples in one
    # tarball, $OUT/gpu-pace.tgz; ~9 min
    D=out/gpu-pace IT=${ITERS:-30} WU=${WARMUP:-10}; mkdir -p "$D"
    for r in $(seq "${ROUNDS:-2}"); do
        for g in 0 1; do
            smi "$D/smi-alone$g-$r.csv"; s=$!
            CUDA_VISIBLE_DEVICES=$g timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $P \
                --mode ddp --batch 16 --layers 8 --hidden 2048 --heads 16 --seq 1024 --iters "$IT" >"$D/alone$g-$r.log" 2>&1
            kill $s
            # a line's period is its previous iteration's, as fidelity_gpu.py reads them
            echo "round $r, GPU $g alone: period $(median "$D/alone$g-$r.log" period $((WU + 1))) ms"
        done
        for dev in cuda:0,1 cuda:1,0; do
            smi "$D/smi-prism-${dev/:/}-$r.csv"; s=$!
            PRISM_LEASE=${PRISM_LEASE:-pace} timeout 250 python3 benchmarks/fidelity_gpu.py --cases ddp-2 --reals 1 \
                --iters "$IT" --warmup "$WU" --prism-devices "$dev" --json "$D/fidelity_gpu_pace_${dev/:/}_$r.json" \
                --work "$D/w-${dev/:/}-$r" 2>&1 | grep -E "real run|prism run:" ; kill $s
        done
    done
    tar czf "$OUT/gpu-pace.tgz" "$D"/*.log "$D"/*.csv "$D"/*.json "$D"/*.md "$D"/w-*/*/*.log 2>/dev/null ;;
lanecost)
    P=benchmarks/programs/issue_cost.py D=out/lanecost; mkdir -p "$D"
    for dt in float32 bfloat16; do
        for pm in "" "--premul 2"; do
            name=real-$dt${pm:+-premul}
            timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 $P --dtype $dt $pm >"$D/$name.log" 2>&1
            echo "$name: $(grep -h '^ISSUE' "$D/$name.log")"
        done
        timeout 200 prism run --world 2 --devices cuda:0,1 --sandbox 1 --out "$D/prism-$dt" --force -- $P --dtype $dt \
            >"$D/prism-$dt.log" 2>&1
        echo "prism-$dt: $(grep -h '^ISSUE' "$D/prism-$dt/logs/emulate.log")"
        python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
print({r: m.get('emulation_native_lane') for r, m in d['sandbox_results'].items()})" "$D/prism-$dt/emulate/emulate.json"
    done
    tar czf "$OUT/lanecost.tgz" "$D"/*.log "$D"/prism-*/emulate/emulate.json "$D"/prism-*/logs/*.log 2>/dev/null ;;
scale)
    # prism run of gpt3d TP2·PP8 (8 layers) at each of WORLDS ranks (default 1024) on the GPUs there, a sandbox rank in
    # the first and the last stage: benchmarks/run_at_scale.py's figures (wall and the prism process's peak host memory
    # by stage, each assistant's RSS and GPU reservation); TAG (h200) names the results; ~1 min at 1,024, ~4 at 131,072
    for W in ${WORLDS:-1024}; do
        B=$(( W < 16384 ? W : 16384 ))
        timeout $((590 - SECONDS)) python3 benchmarks/run_at_scale.py --world "$W" --devices "${DEVICES:-auto}" --tp 2 \
            --pp 8 --layers 8 --global-batch "$B" --sandbox "0,$((W - 1))" --parallel "${PARALLEL:-4}" --no-browser \
            --machine "${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)}" --work out/scale --tag "${TAG:-h200}_$W" >"$OUT/scale-$W.log" 2>&1
        echo "scale $W: $?"; grep -A3 "^| world" "$OUT/scale-$W.log"
        cp benchmarks/results/run_at_scale_"${TAG:-h200}_$W".json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/scale-logs.tgz" "$OUT"/scale-*.log out/scale/*/logs out/scale/*/run.json 2>/dev/null ;;
cpu-fid)
    N=${2:?usage: device_suite.sh cpu-fid N}
    cores=$(nproc)
    name=${FID_JSON:-fidelity_cpu_${cores}c}
    [ -f "benchmarks/results/$name.json" ] && cp "benchmarks/results/$name.json" "$OUT/"
    # the native recorder is built once here, outside the runs' clocks (~40 s)
    timeout 200 python3 -c "from prismllm.comm.native import load; load()" >"$OUT/native-build.log" 2>&1 \
        || { echo "native build failed (the runs record through the Python path)"; tail -5 "$OUT/native-build.log"; }
    # FID_ARGS: fidelity.py options (default --noise), e.g. "--repeats 3" or --compute-under-load
    timeout $((585 - SECONDS)) python3 benchmarks/fidelity.py --devices cpu --worlds "$N" --cases "${3:-tp,pp,vpp}" \
        ${FID_ARGS:---noise} --merge --timeout 300 \
        --json "$OUT/$name.json" 2>&1 | tee "$OUT/cpu-fid-$N.log" | grep -v "^\[" ;;
*)
    echo "unknown part $PART"; exit 2 ;;
esac
