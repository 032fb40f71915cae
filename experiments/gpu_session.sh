#!/usr/bin/env bash
# The GPU measurements, in stages that each fit one call of a lent GPU machine
# (under 10 minutes). Run from the repository root on the GPU machine:
#
#   bash experiments/gpu_session.sh setup tests sanity     # first call
#   bash experiments/gpu_session.sh setup tune bench128    # next calls ...
#
# Logs and JSON go to $OUT (default /tmp/gpu_out). `setup` installs this
# repository (editable, no dependencies: the machine's image has JAX with CUDA,
# flax, optax and orbax) and the pure-Python wheels it lacks, carried in .whl/.
#
# The copy of the tree that reaches the GPU machine carries a `.git` that need
# not describe it, so the results' git revision comes from .whl/REVISION,
# written on the sending side from a clean tree just before the call:
#   test -z "$(git status --porcelain --untracked-files=no)" && git rev-parse HEAD > .whl/REVISION
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=python3
if [ -f .whl/REVISION ]; then
  export ATTENTION_JAX_GIT_REVISION=$(cat .whl/REVISION)
fi

setup() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
  fi
  if ! $PY -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
    # The installed layout without pip: kernels/ is attention_jax.kernels.
    ln -sfn ../kernels attention_jax/kernels && export PYTHONPATH=$PWD
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
      --format=csv | tee "$OUT/gpu.txt"
  $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); \
print(jax.devices(), jax.devices()[0].compute_capability)" | tee -a "$OUT/gpu.txt"
}

tests() {
  # Every kernel test on the hardware (the Triton and Mosaic GPU kernels run
  # natively; the TPU kernel's tests run in its interpreter, as on CPU), without
  # the CPU-only XLA flags of tests/conftest.py (this JAX's XLA may not know them).
  ATTENTION_JAX_TEST_XLA_FLAGS=0 timeout 150 $PY -m pytest tests/kernels -q -n 8 -p no:cacheprovider \
      2>&1 | tee "$OUT/tests_kernels.log" | tail -60
}

tests_block_sparse() {  # every sparse pattern through the Triton kernels, natively
  timeout 150 $PY -m pytest tests/variants/test_sparse.py -q -n 8 -p no:cacheprovider \
      -k "block_sparse" 2>&1 | tee "$OUT/tests_block_sparse.log" | tail -30
}

bench_block_sparse() {  # kernel time against block density (#20 item 2), bfloat16
  timeout 270 $PY -m experiments.benchmark_block_sparse --implementation=pallas_gpu \
      --dtype=bfloat16 --length=16384 --heads=8 --head_dim=64 --repeats=10 \
      --out="$OUT/block_sparse_gpu.json" 2>&1 | tee "$OUT/bench_block_sparse.log" | tail -25
}

tests_defaults() {  # the tests that run the default block sizes
  timeout 120 $PY -m pytest tests/kernels/test_pallas_gpu.py -q -n 8 -p no:cacheprovider \
      -k "default_block or head_dims or long_sequences" 2>&1 | tail -3
}

sanity() {
  timeout 240 $PY -m experiments.benchmark_attention --dtype=bfloat16 --lengths=8192 \
      --head_dims=128 --modes=fwd,fwd_bwd --repeats=10 --out="$OUT/attention_gpu_sanity.json" \
      2>&1 | tee "$OUT/sanity.log" | tail -30
}

# The kernels that have only run interpreted before 2026-11-28: flex_attention
# on the Triton kernels, the chunkwise mixers' Triton chunk kernels, and the
# two benchmarks' GPU paths.
tests_new() {
  ATTENTION_JAX_TEST_XLA_FLAGS=0 timeout 90 $PY -m pytest tests/kernels/test_flex_gpu.py \
      tests/kernels/test_chunkwise_kernel.py tests/test_benchmark_flex.py \
      tests/test_benchmark_chunkwise.py -k "gpu or triton or kernel_form" -q -n 8 \
      -p no:cacheprovider 2>&1 | tee "$OUT/tests_new.log" | tail -25
}

flex_gpu() {  # #41 item 2: flex on Triton against our plain Triton kernel and jax.nn
  timeout 160 $PY -m experiments.benchmark_flex --implementation=pallas_gpu --dtype=bfloat16 \
      --lengths=8192,32768 --heads=8 --head_dim=128 --repeats=10 --max_dense_bytes=17179869184 \
      --out="$OUT/flex_gpu.json" 2>&1 | tee "$OUT/flex_gpu.log" | tail -22
}

chunkwise_delta_gpu() {  # the delta rule's kernels asked for 344 KB of shared memory at
  # C = 64 (the H200 gives a block 227 KB): smaller chunks, each a file of its own
  for chunk in 32 16; do
    timeout 100 $PY -m experiments.benchmark_chunkwise --chunkwise_implementation=pallas_gpu \
        --exact_implementation=pallas --dtype=bfloat16 --batch=8 --heads=16 --key_dim=64 \
        --value_dim=64 --lengths=4096,32768 --modes=fwd_bwd --max_recurrent_length=1 \
        --mixers=delta_net,gated_delta_net --chunk_size=$chunk --repeats=5 \
        --out="$OUT/chunkwise_delta_c$chunk.json" 2>&1 | tail -6
  done
}

chunkwise_gpu() {  # #41 item 3: the chunk kernels against our exact (Triton) kernel
  timeout 130 $PY -m experiments.benchmark_chunkwise --chunkwise_implementation=pallas_gpu \
      --exact_implementation=pallas --dtype=bfloat16 --batch=8 --heads=16 --key_dim=64 \
      --value_dim=64 --lengths=4096,32768 --modes=fwd_bwd --max_recurrent_length=1 \
      --repeats=5 --out="$OUT/chunkwise_gpu.json" 2>&1 | tee "$OUT/chunkwise_gpu.log" | tail -12
}

tune() {
  timeout 330 $PY -m experiments.tune_block_sizes --seq_len=8192 --head_dims=128,64 \
      --out="$OUT/block_sizes_gpu.json" 2>&1 | tee "$OUT/tune.log" | tail -12
}

bench() {  # bench D LENGTHS TIMEOUT
  timeout "$3" $PY -m experiments.benchmark_attention --dtype=bfloat16 --lengths="$2" \
      --head_dims="$1" --repeats=5 --impls=attention_jax:pallas,attention_jax:pallas_mgpu --out="$OUT/attention_gpu_d$1.json" \
      2>&1 | tee "$OUT/bench_d$1.log" | tail -90
}

lra_speed4k() {  # the LRA speed table's 4K column at the paper's batch 32, tarred to $OUT
  timeout 270 $PY -m experiments.reproduce --table=configs/tables/lra_speed.py \
      --results=results/lra_speed_gpu/ --only=length=4096 2>&1 | tee "$OUT/lra_speed.log" | tail -30
  tar cf "$OUT/lra_speed_gpu.tar" results/lra_speed_gpu
}

# The whole LRA speed table (configs/tables/lra_speed.py: 11 variants x 1K-4K,
# batch 32) in one call: SPEED_JOBS cells compile side by side (CPU work) and
# are timed one at a time (ATTENTION_JAX_TIMING_LOCK, experiments/
# benchmark_lra_speed.py), longest lengths first. Then two cells again, each
# alone on the machine, into $SPEED_RESULTS.alone/: a check that the side-by-side
# compiles did not move the timings. The finished cells are tarred to $OUT.
SPEED_RESULTS=${SPEED_RESULTS:-results/lra_speed_gpu}
lra_speed_all() {  # lra_speed_all SECONDS
  local table=configs/tables/lra_speed.py logs=/tmp/lra_speed_logs
  mkdir -p $logs
  $PY -c "import runpy; m = runpy.run_path('$table')
for length in reversed(m['LENGTHS']):
  for variant in m['VARIANTS']: print(variant, length)" |
    ATTENTION_JAX_TIMING_LOCK=/tmp/lra_speed.lock timeout "$1" xargs -r -P "${SPEED_JOBS:-6}" -L 1 \
      sh -c "$PY -m experiments.reproduce --table=$table --results=$SPEED_RESULTS/ \
        --only=variant=\$0 --only=length=\$1 > $logs/\$0_\$1.log 2>&1; \
        grep -h '^{\"variant' $logs/\$0_\$1.log || tail -n 3 $logs/\$0_\$1.log"
  tar cf "$OUT/lra_speed_gpu.tar" $SPEED_RESULTS $logs 2>/dev/null
  for cell in "dot_product 2048" "linear 4096"; do
    set -- $cell
    timeout 90 $PY -m experiments.reproduce --table=$table --results=$SPEED_RESULTS.alone/ \
        --only=variant=$1 --only=length=$2 2>&1 | grep '^{"variant'
  done
  tar cf "$OUT/lra_speed_gpu.tar" $SPEED_RESULTS $SPEED_RESULTS.alone $logs 2>/dev/null
}

# The speed table's cells the H200 run of 2026-11-27 lacks, each alone on the
# machine: performer at 1K (cut off), and the Transformer at 4K with the
# release's attention dropout given 95% of the GPU's memory (XLA's plan was
# 88.2 GB; the default fraction, 75%, refused it).
lra_speed_rest() {
  local table=configs/tables/lra_speed.py
  timeout 60 $PY -m experiments.reproduce --table=$table --results=$SPEED_RESULTS/ \
      --only=variant=performer --only=length=1024 2>&1 | grep -h '^{"variant' 
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 110 $PY -m experiments.reproduce --table=$table \
      --results=$SPEED_RESULTS/ --only=variant=dot_product --only=length=4096 2>&1 |
    grep -h -m 3 '^{"variant\|RESOURCE_EXHAUSTED\|Error'
  tar cf "$OUT/lra_speed_gpu.tar" $SPEED_RESULTS 2>/dev/null
}

# The full-size ListOps column (configs/tables/lra.py, the paper's model, batch
# 32, 5,000 steps): two queues of cells in the background, outside the
# repository (the tree is re-sent with each call), so they outlive one call
# while the machine is held. `listops_wait SECONDS` follows them and tars the
# finished cells (no checkpoints) into $OUT every minute.
LRA_RUNS=/tmp/lra_gpu
listops_start() {
  mkdir -p $LRA_RUNS
  $PY -m experiments.make_data --task=listops --data_dir=$LRA_RUNS/data 2>&1 | tail -4
  local common="--table=configs/tables/lra.py --results=$LRA_RUNS/results/ --data_dir=$LRA_RUNS/data --only=task=listops --only=preset=method --only=seed=0"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 setsid nohup $PY -m experiments.reproduce $common \
      --only=variant=dot_product > $LRA_RUNS/queue_a.log 2>&1 < /dev/null &
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 setsid nohup $PY -m experiments.reproduce $common \
      --only=variant=linformer,performer,linear > $LRA_RUNS/queue_b.log 2>&1 < /dev/null &
  sleep 5
}

listops_tar() {
  (cd $LRA_RUNS && tar cf "$OUT/lra_gpu.tar" --exclude=checkpoints queue_a.log queue_b.log \
      results 2>/dev/null)
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  for f in $LRA_RUNS/results/runs/listops/*/method/seed0/metrics.jsonl; do
    [ -f "$f" ] && echo "$f: $(tail -1 "$f" | cut -c1-200)"
  done
}

listops_wait() {  # listops_wait SECONDS
  local end=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt "$end" ]; do
    listops_tar
    if ! pgrep -f "experiments.reproduce" >/dev/null; then echo "queues finished"; break; fi
    sleep 60
  done
  listops_tar
  tail -n 5 $LRA_RUNS/queue_a.log $LRA_RUNS/queue_b.log
}

# #19: what a ViT needs to learn Pathfinder-32, where the smoke preset stays at
# chance on CPU. Runs side by side on the one GPU; the data sets are made first,
# once each (the generator uses every core), by a 1-step run per data set.
# A summary and each run's command, log tail and train curve go to $OUT/vit_pf/.
VIT_RUNS=/tmp/vit_pf
vit_pathfinder() {
  local vit="configs/lra/pathfinder32.py:dot_product,vit,smoke"
  local pixels="configs/lra/pathfinder32.py:dot_product,smoke"
  local easy40="--config.task_options.train_size=40000"
  local hard="--config.task_options.train_size=159840 --config.task_options.difficulty=hard --config.task_options.validation_size=4000 --config.task_options.test_size=4000"
  local big="--config.model.num_layers=4 --config.model.embed_dim=128 --config.model.num_heads=4 --config.model.mlp_dim=256 --config.model.head_mlp_dim=256"
  local long="--config.num_train_steps=10000 --config.batch_size=128 --config.optimizer.warmup_steps=500 --config.eval_every=500 --config.checkpoint_every=500"
  local quiet="--config.progress=False --config.data_dir=$VIT_RUNS/data"
  declare -A runs=(
    [smoke]="$vit"
    [easy40k_5k]="$vit $easy40 --config.num_train_steps=5000 --config.batch_size=64 --config.eval_every=500 --config.checkpoint_every=500"
    [easy40k_big]="$vit $easy40 $big $long"
    [easy40k_big_mean]="$vit $easy40 $big $long --config.model.pooling=mean"
    [easy40k_big_p2]="$vit $easy40 $big $long --config.model.patch_size=2"
    [easy40k_big_lr3e-4]="$vit $easy40 $big $long --config.optimizer.learning_rate=3e-4"
    [easy4k_big]="$vit $big $long"
    [hard_big]="$vit $hard $big $long --config.batch_size=256"
    [hard_big_p2]="$vit $hard $big $long --config.batch_size=256 --config.model.patch_size=2"
    [pixels_easy40k]="$pixels $easy40 --config.num_train_steps=5000 --config.batch_size=64 --config.eval_every=500 --config.checkpoint_every=500"
  )
  if [ "${VIT_SET:-1}" = 2 ]; then  # second round: smaller patches, other positions and pooling
    local b64="--config.num_train_steps=5000 --config.batch_size=64 --config.eval_every=500 --config.checkpoint_every=500"
    local smoke2k="--config.num_train_steps=2000 --config.eval_every=250 --config.checkpoint_every=250"
    runs=(
      [p1_easy40k]="$vit $easy40 $b64 --config.model.patch_size=1"
      [p2_easy40k]="$vit $easy40 $b64 --config.model.patch_size=2"
      [p2_easy40k_sin_mean]="$vit $easy40 $long --config.model.patch_size=2 --config.model.position=sinusoidal --config.model.pooling=mean"
      [p4_easy40k_sin_mean]="$vit $easy40 $long --config.model.position=sinusoidal --config.model.pooling=mean"
      [p4_easy40k_big_lr1e-4]="$vit $easy40 $big $long --config.optimizer.learning_rate=1e-4"
      [p1_smoke_2k]="$vit $smoke2k --config.model.patch_size=1"
      [p2_smoke_4k]="$vit --config.num_train_steps=4000 --config.eval_every=500 --config.checkpoint_every=500 --config.model.patch_size=2"
      [pixels_smoke_2k]="$pixels $smoke2k"
    )
  fi
  mkdir -p $VIT_RUNS "$OUT/vit_pf"
  local datasets=("$easy40" "$hard")
  [ "${VIT_SET:-1}" = 2 ] && datasets=("$easy40")
  for data in "${datasets[@]}"; do  # ($vit alone: the smoke data set)
    $PY -m experiments.train --config=$vit $data $quiet --config.num_train_steps=1 --config.optimizer.warmup_steps=0 \
        --workdir=$VIT_RUNS/prep_$RANDOM 2>&1 | tail -2 &
  done
  $PY -m experiments.train --config=$vit $quiet --config.num_train_steps=1 --config.optimizer.warmup_steps=0 \
      --workdir=$VIT_RUNS/prep_smoke 2>&1 | tail -2
  wait
  for name in "${!runs[@]}"; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.09 timeout "${VIT_TIMEOUT:-300}" $PY -m experiments.train \
        --config=${runs[$name]} $quiet --workdir=$VIT_RUNS/$name > $VIT_RUNS/$name.log 2>&1 &
  done
  wait
  for name in "${!runs[@]}"; do  # one file per run (a call brings back few files)
    { echo "${runs[$name]}"; tail -5 $VIT_RUNS/$name.log
      grep '"train"' $VIT_RUNS/$name/metrics.jsonl 2>/dev/null | awk 'NR % 20 == 0' | cut -c1-120
    } > "$OUT/vit_pf/$name.txt"
  done
  $PY - $VIT_RUNS "${!runs[@]}" <<'PYEOF' | tee "$OUT/vit_pf/summary.txt"
import json, pathlib, sys
for run in sorted(pathlib.Path(sys.argv[1]) / name for name in sys.argv[2:]):
  path = run / "results.json"
  if not path.exists():
    evals = [json.loads(line) for line in open(run / "metrics.jsonl") if '"validation"' in line] \
        if (run / "metrics.jsonl").exists() else []
    print(f"{run.name:22s} unfinished; last validation {evals[-1] if evals else None}"); continue
  metrics = json.loads(path.read_text())["metrics"]
  print(f"{run.name:22s} best val {metrics['best_validation']['accuracy']:.3f} at "
        f"{metrics['best_validation']['step']}, test {metrics['test']['accuracy']:.3f}, train "
        f"{metrics['train']['accuracy']:.3f}, {metrics['steps_per_s']:.0f} steps/s")
PYEOF
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    bench64) bench 64 4096,16384 200 ;;
    bench128) bench 128 1024,4096,8192,16384,32768 340 ;;
    listops_wait*) listops_wait "${stage#listops_wait}" ;;
    lra_speed_all*) lra_speed_all "${stage#lra_speed_all}" ;;
    *) "$stage" ;;
  esac
done
echo "=== done $(date +%T)"
