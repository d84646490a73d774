#!/usr/bin/env bash
# The GPU checks in one run, within GPU_CHECK_BUDGET_S seconds (default 540; on one H200 the whole
# list takes longer, and what no longer fits is skipped and named in the summary), in the order of
# what they decide: the CUDA tests (and the fake-device tests of the same paths) under ringcomm-run
# at np 1 and 2; one CUDA allreduce at np 2 three ways (pinned memory, the arena with stream waits,
# the arena with host waits), then split into phases by tools/allreduce_phases.py, and a 4 KiB one's
# host time function by function (its --profile); `bench training
# --device cuda` (resnet18, two ranks on one GPU, batch 64 and 256: DistributedOptimizer vs DDP on
# gloo vs DDP on the "ringcomm" backend vs the bound of independent processes with no exchange,
# alternating rounds); DDP on the "ringcomm" backend with every per-tensor op through the arena;
# a SyncBatchNorm training step against a BatchNorm one, its backward's small allreduces through
# pinned memory and through the arena; `bench allreduce --device cuda` (4 KiB, 1 MiB, 64 MiB at np 2 and 4, vs
# gloo) and the floor of a bare exchange under them (tools/device_floor.py); training with host waits; the tests at np 4 and at np 4 as two named hosts; training
# through pinned memory; FSDP2 on gloo and on "ringcomm"; the floor and the allreduce ways under MPS; DistributedOptimizer and DDP on the
# "ringcomm" backend under torch.profiler (where the host waits for the GPU); the shared-memory
# allreduce of host arrays on 1 thread per rank vs 4.  Every log goes to $OUT (default: ./gpu-check-out): at most seven files, the benches'
# raw numbers packed in one archive.  summary.txt starts with the machine and grows after each
# step, so a run cut short still tells what it measured.
#
# Needs python3 with torch (CUDA), numpy, msgpack, pytest and torchvision.  pyzmq (and, if given,
# this project and yappi) are installed from the wheels in .whl/ into /tmp/site; otherwise the repository
# itself is imported.  Run from the repository root:   bash tools/gpu_check.sh
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-check-out}"
PY="${PYTHON:-python3}"
RAW="$(mktemp -d)"  # the benches' JSON and Markdown, packed into $OUT/bench-raw.tgz after each step
export PY RAW  # for the steps that run a loop in bash -c
mkdir -p "$OUT"
cd "$ROOT" || exit 1

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: installing the wheels in .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's code wins over an installed copy
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# the buckets and large single tensors reduce on the GPU through CUDA IPC (the default) in every step
# but the pinned comparisons
export RINGCOMM_DEVICE_IPC=1

STATUS=()
SUMMARY="$OUT/summary.txt"
# the whole run ends within BUDGET seconds (default 540, inside a 10-minute lease call): a step gets at
# most what is left, and a step with under 20 s left is skipped and named in the summary
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
step() {  # step NAME SECONDS COMMAND...: run it with a deadline, log to $OUT/NAME.log, note the result
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then
        STATUS+=("$name: skipped, ${left} s of the ${BUDGET} s budget left")
        echo "gpu_check: ${STATUS[-1]}" | tee -a "$SUMMARY"
        return 125
    fi
    ((limit > left)) && limit=$left
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    STATUS+=("$name: exit $rc in $((SECONDS - start)) s (limit $limit s)")
    echo "gpu_check: ${STATUS[-1]}" | tee -a "$SUMMARY"
    # the raw numbers so far, so that a run cut short still brings them back
    tar czf "$OUT/bench-raw.tgz" --exclude='*.trace.json' -C "$RAW" . 2>/dev/null
    return $rc
}

{ nvidia-smi; "$PY" -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, torch.cuda.get_device_name(0))'; } \
    >"$SUMMARY" 2>&1

TESTS=(-m pytest -q -p no:cacheprovider -o addopts= tests/torch/test_cuda.py tests/torch/test_device_buckets.py
       tests/torch/test_device_return.py tests/torch/test_device_collectives.py tests/torch/test_device_ipc.py
       tests/torch/test_device_arena.py tests/torch/test_device_arena_broadcast.py
       tests/torch/test_device_arena_shards.py)
cuda_tests() {  # cuda_tests NAME LIMIT [ENV=VALUE...] NP: the tests at NP ranks (1: no launcher), one log for all
    local name="$1" limit="$2"
    shift 2
    local np="${*: -1}" run=("$PY" "${TESTS[@]}")
    ((np > 1)) && run=("$PY" -m ringcomm.launch.launcher -np "$np" "${run[@]}")
    # an 8 MiB arena: the tests' large tensor then takes 8 MiB, not 256, on each rank's fake device;
    # every size through it, so that the tests' small tensors take it too
    step "$name" "$limit" env RINGCOMM_DEVICE_IPC_ARENA_BYTES=8388608 RINGCOMM_DEVICE_IPC_MIN_BYTES=0 \
        "${@:1:$#-1}" "${run[@]}"
    { echo "=== $name"; cat "$OUT/$name.log"; } >>"$OUT/cuda-tests.log" && rm -f "$OUT/$name.log"
    grep -h "^=== $name\|passed\|failed\|error" "$OUT/cuda-tests.log" | tail -n 3 >>"$SUMMARY"
}

training() {  # training BATCH LIMIT REPEATS: the four setups side by side in one run, rounds alternating
    step "training-b$1" "$2" "$PY" -m ringcomm.bench training --device cuda --np 2 --batch "$1" \
        --steps 20 --warmup 5 --repeats "$3" --setups ddp ddp_ringcomm ringcomm independent --no-plot --out-dir "$RAW" \
        --json "$RAW/training-b$1.json"
    grep -h "img/s\|^| \|per round" "$OUT/training-b$1.log" >>"$SUMMARY"
}

# the steps in the order of what they decide, so that a short lease still measures the bars: the
# CUDA tests at np 1 and 2, the three ways of a CUDA allreduce side by side, training at batch 64,
# the CUDA allreduces against gloo and the floor under them, the host waits in training, training at batch 256, then the
# tests at np 4, the pinned comparison, MPS, the profile and the rest (the small op's profile runs
# beside its phases)
cuda_tests cuda-tests-np1 90 1
cuda_tests cuda-tests-np2 120 2

way_env() {  # way_env pinned|stream|host: the settings of one way of a CUDA allreduce
    if [ "$1" = pinned ]; then echo RINGCOMM_DEVICE_IPC=0; else
        echo RINGCOMM_DEVICE_IPC_MIN_BYTES=0 RINGCOMM_DEVICE_IPC_WAIT="$1"; fi
}
export -f way_env

# one CUDA allreduce three ways at np 2, alternating: through pinned memory (RINGCOMM_DEVICE_IPC=0),
# through the arena with the side stream waiting for the peer's events (stream), and with a host
# thread waiting for them instead (host): whether a stream that waits on another process's work
# costs the two ranks sharing one GPU a time slice
step ipc-ways 120 bash -c 'for round in 1 2; do for way in pinned stream host; do
    echo "way $way, round $round"
    env $(way_env $way) "$PY" -m ringcomm.bench allreduce --device cuda --np 2 --sizes 4K 1M 64M --repeats 1 \
        --systems ringcomm --no-plot --out-dir "$RAW" --json "$RAW/ipc-$way-$round.json" | grep "^| 2 "
done; done'
grep -h "^way\|^| 2 " "$OUT/ipc-ways.log" >>"$SUMMARY"
mv "$OUT/ipc-ways.log" "$RAW/" 2>/dev/null

# the same three ways split into phases (tools/allreduce_phases.py): the caller's call, its
# synchronize(), and what the GPU still had to do after it
step phases 90 bash -c 'for way in pinned stream host; do
    env $(way_env $way) "$PY" -m ringcomm.launch.launcher -np 2 "$PY" tools/allreduce_phases.py --sizes 4K 1M 64M --ops 100
done'
grep -h "phases np" "$OUT/phases.log" | sed "s/^\[0\]<stdout>://" >>"$SUMMARY"
mv "$OUT/phases.log" "$RAW/" 2>/dev/null

# where a 4 KiB op's host time goes (its call and synchronize cost most of it): rank 0's costliest
# functions per op on each thread, through pinned memory and through the arena (yappi from .whl/, CPU
# time; without it cProfile, the calling thread only)
step phases-profile 45 bash -c 'for way in pinned stream; do
    env $(way_env $way) "$PY" -m ringcomm.launch.launcher -np 2 "$PY" tools/allreduce_phases.py --sizes 4K --ops 20 \
        --profile 500
done'
grep -h "^\[0\]<stdout>:" "$OUT/phases-profile.log" | sed "s/^\[0\]<stdout>://" >>"$SUMMARY"
mv "$OUT/phases-profile.log" "$RAW/" 2>/dev/null

training 64 200 3

# DDP on the "ringcomm" backend with every per-tensor op through the arena
# (RINGCOMM_DEVICE_IPC_MIN_BYTES=0: its first bucket and the buffers it broadcasts at each forward,
# so that forward does not wait for the GPU) beside DDP on gloo, alternating rounds
RINGCOMM_DEVICE_IPC_MIN_BYTES=0 step training-b64-ddp-arena 80 "$PY" -m ringcomm.bench training --device cuda \
    --np 2 --batch 64 --steps 20 --warmup 5 --repeats 3 --setups ddp ddp_ringcomm --no-plot --out-dir "$RAW" \
    --json "$RAW/training-b64-ddp-arena.json"
{ echo "RINGCOMM_DEVICE_IPC_MIN_BYTES=0:"; grep -h "img/s\|^| " "$OUT/training-b64-ddp-arena.log"; } >>"$SUMMARY"
mv "$OUT/training-b64-ddp-arena.log" "$RAW/" 2>/dev/null

# a training step with hvd.SyncBatchNorm against the same step with torch's BatchNorm2d: two ranks on
# one GPU, a conv net at batch 64, DistributedOptimizer, alternating rounds; every rank's running
# statistics must agree after the SyncBatchNorm steps
cat >"$RAW/syncbn_step.py" <<'PYEOF'
import time

import torch
import ringcomm_torch as hvd

hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())


def net(norm):
    torch.manual_seed(0)
    layers = []
    for cin, cout in ((3, 32), (32, 64), (64, 64)):
        layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), norm(cout), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(64, 10)).cuda()


def timed(model, steps=20, warmup=5):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(64, 3, 32, 32, device="cuda") + hvd.rank()
    y = torch.randint(0, 10, (64,), device="cuda")
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


plain, synced = net(torch.nn.BatchNorm2d), net(hvd.SyncBatchNorm)
rounds = [(timed(plain), timed(synced)) for _ in range(3)]
stats = hvd.allgather(synced[1].running_mean.unsqueeze(0))
assert all(torch.allclose(stats[0], row) for row in stats), "SyncBatchNorm running means differ between ranks"
if hvd.rank() == 0:
    for bn, sbn in rounds:
        print(f"syncbn: BatchNorm2d {bn:.2f} ms/step, SyncBatchNorm {sbn:.2f} ms/step, ratio {sbn / bn:.2f}")
PYEOF
# its backward's small allreduces (a few hundred bytes; its forward's allgathers always take pinned
# memory) through pinned memory (the default RINGCOMM_DEVICE_IPC_MIN_BYTES) and through the arena
# (0), alternating launches
step syncbn 110 bash -c 'for mb in default 0 default 0; do
    echo "syncbn launch with RINGCOMM_DEVICE_IPC_MIN_BYTES=$mb"
    if [ "$mb" = 0 ]; then export RINGCOMM_DEVICE_IPC_MIN_BYTES=0; else unset RINGCOMM_DEVICE_IPC_MIN_BYTES; fi
    "$PY" -m ringcomm.launch.launcher -np 2 "$PY" "$RAW/syncbn_step.py"
done'
grep -h "syncbn\|Error\|error" "$OUT/syncbn.log" | tail -n 16 >>"$SUMMARY"

step allreduce-cuda 90 "$PY" -m ringcomm.bench allreduce --device cuda --np 2 4 --sizes 4K 1M 64M --repeats 2 \
    --systems ringcomm gloo --no-plot --out-dir "$RAW" --json "$RAW/allreduce-cuda.json"
grep -h "^| " "$OUT/allreduce-cuda.log" >>"$SUMMARY"

# the floor under the phases above (tools/device_floor.py): the same device copies, a bare host handshake
# and interprocess events between the two ranks, with none of ringcomm's work; the phases minus the
# floor is ringcomm's own cost, and the floor itself what sharing one GPU costs
step floor 40 bash -c 'for size in 4K 1M; do
    "$PY" -m ringcomm.launch.launcher -np 2 "$PY" tools/device_floor.py --bytes $size --ops 300
done'
grep -h "<stdout>:floor " "$OUT/floor.log" | sed "s/^\[0\]<stdout>://" >>"$SUMMARY"
mv "$OUT/floor.log" "$RAW/" 2>/dev/null

# DistributedOptimizer with the host waiting for the peers' events (RINGCOMM_DEVICE_IPC_WAIT=host),
# beside the default's rounds above
RINGCOMM_DEVICE_IPC_WAIT=host step training-b64-host-waits 120 "$PY" -m ringcomm.bench training --device cuda \
    --np 2 --batch 64 --steps 20 --warmup 5 --repeats 3 --setups ringcomm --no-plot --out-dir "$RAW" \
    --json "$RAW/training-b64-host-waits.json"
{ echo "RINGCOMM_DEVICE_IPC_WAIT=host:"; grep -h "img/s\|^| " "$OUT/training-b64-host-waits.log"; } >>"$SUMMARY"
mv "$OUT/training-b64-host-waits.log" "$RAW/" 2>/dev/null

training 256 200 3
cuda_tests cuda-tests-np4 120 4
# four ranks that name two hosts (rank r on host r % 2): each host's ranks share their GPU buffers,
# and only each rank's shard of its host's sum goes through pinned memory and TCP between the "hosts"
cuda_tests cuda-tests-np4-two-hosts 120 ARENA_TEST_HOSTS=2 4

# DistributedOptimizer through pinned host memory (RINGCOMM_DEVICE_IPC=0) beside the runs above, which
# reduce on the GPU through CUDA IPC (two ranks share the GPU)
RINGCOMM_DEVICE_IPC=0 step training-b64-pinned 120 "$PY" -m ringcomm.bench training --device cuda --np 2 --batch 64 \
    --steps 20 --warmup 5 --repeats 3 --setups ringcomm --no-plot --out-dir "$RAW" --json "$RAW/training-b64-pinned.json"
{ echo "RINGCOMM_DEVICE_IPC=0:"; grep -h "img/s\|^| " "$OUT/training-b64-pinned.log"; } >>"$SUMMARY"
mv "$OUT/training-b64-pinned.log" "$RAW/" 2>/dev/null

# FSDP2 on gloo and on the "ringcomm" backend (its parameter gathers and gradient reduce-scatters
# through the arenas, every size), resnet18 at batch 64, alternating rounds
RINGCOMM_DEVICE_IPC_MIN_BYTES=0 step training-b64-fsdp 90 "$PY" -m ringcomm.bench training --device cuda \
    --np 2 --batch 64 --steps 10 --warmup 3 --repeats 2 --setups fsdp fsdp_ringcomm --no-plot --out-dir "$RAW" \
    --json "$RAW/training-b64-fsdp.json"
{ echo "FSDP2:"; grep -h "img/s\|^| \|FAILED" "$OUT/training-b64-fsdp.log" | tail -n 8; } >>"$SUMMARY"
mv "$OUT/training-b64-fsdp.log" "$RAW/" 2>/dev/null

# the floor and the same ways under CUDA's multi-process service (MPS), where both ranks' work runs
# in one context: its own pipe folder, so no other step's process joins it; stopped at the end
step mps 110 bash -c 'command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control here"; exit 3; }
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/gpu-check-mps CUDA_MPS_LOG_DIRECTORY=/tmp/gpu-check-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS did not start"; exit 4; }
    "$PY" -m ringcomm.launch.launcher -np 2 "$PY" tools/device_floor.py --bytes 4K --ops 300 | sed "s/^\[0\]<stdout>:floor /MPS floor /"
    for way in stream host; do
        echo "MPS, way $way"
        RINGCOMM_DEVICE_IPC_MIN_BYTES=0 RINGCOMM_DEVICE_IPC_WAIT=$way "$PY" -m ringcomm.bench allreduce --device cuda \
            --np 2 --sizes 4K 1M 64M --repeats 1 --systems ringcomm gloo --no-plot --out-dir "$RAW" \
            --json "$RAW/mps-$way.json" | grep "^| 2 "
    done
    echo quit | nvidia-cuda-mps-control'
grep -h "^MPS\|^| 2 \|^no nvidia\|did not start" "$OUT/mps.log" >>"$SUMMARY"
mv "$OUT/mps.log" "$RAW/" 2>/dev/null

# where the host waits for the GPU: 3 steps of ringcomm_torch under torch.profiler on rank 0 (the
# summary counts synchronizes and copies per thread and lists the costliest ops; the trace stays
# here, it is too large to bring back)
step profile-b64 120 "$PY" -m ringcomm.launch.launcher -np 2 "$PY" -m ringcomm.bench._train_worker \
    --mode ringcomm --device cuda --model resnet18 --batch 64 --steps 10 --warmup 5 \
    --out "$RAW/profile-b64-run.json" --profile "$RAW/profile-b64.json"
mv "$OUT/profile-b64.log" "$RAW/" 2>/dev/null  # into the archive: few files come back
cat "$RAW/profile-b64.json" >>"$SUMMARY" 2>/dev/null
# the same for DDP on the "ringcomm" backend (its buckets through the arena, its futures completed
# by the backend's thread); rank 0's summary in the archive
step profile-b64-ddp 90 bash -c 'port=$((29500 + RANDOM % 1000)); for r in 0 1; do
    "$PY" -m ringcomm.bench._train_worker --rank $r --world-size 2 --port $port --mode ddp_ringcomm --device cuda \
        --model resnet18 --batch 64 --steps 10 --warmup 5 --out "$RAW/profile-b64-ddp-run.json" \
        --profile "$RAW/profile-b64-ddp.json" &
done; wait'
mv "$OUT/profile-b64-ddp.log" "$RAW/" 2>/dev/null

# the shared-memory allreduce's copies and sums on 1 thread per rank vs 4 (RINGCOMM_SHM_ALLREDUCE_THREADS;
# the default takes 4 with 2 ranks on 16 cores), host arrays, alternating twice
step shm-threads 90 bash -c 'for t in 1 4 1 4; do
    echo "threads $t"
    RINGCOMM_SHM_ALLREDUCE_THREADS=$t "$0" -m ringcomm.bench allreduce --np 2 --sizes 16M 64M --repeats 2 \
        --systems ringcomm --no-plot --out-dir "$1" --json "$1/shm-threads-$t-$RANDOM.json" | grep "^| 2 "
done' "$PY" "$RAW"
grep -h "^threads\|^| 2 " "$OUT/shm-threads.log" >>"$SUMMARY"
mv "$OUT/shm-threads.log" "$RAW/" 2>/dev/null

tar czf "$OUT/bench-raw.tgz" --exclude='*.trace.json' -C "$RAW" .
cat "$SUMMARY"
