#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md ("GPU") in one command, from the repository root of a
# machine with an NVIDIA GPU and jax[cuda]:
#
#     bash experiments/gpu_campaign.sh              # all parts, ~30 min on an H100
#     bash experiments/gpu_campaign.sh env lm routing   # some parts
#
# Parts (each a few minutes on one GPU), in the order they run, the parts that measure open
# targets first: env, lm, routing, lm_profile, layer, grouped, step, variants, flags, profile,
# decode, tests. Measured on an H200 with a warm machine: "lm" 60-65 s a run (one run without
# LM_ROUTERS, one per router with it), "lm_profile" 25 s, "routing" about 9 min (its 8 models,
# the plain router and 7 options, take 60-70 s each to build and compile on a 16-core host,
# then 5 rounds of timing: at the edge of the default RUN_LIMIT; give it RUN_LIMIT=600).
# Results go to $OUT (default runs/gpu_campaign, git-ignored) as each run finishes, 8 files:
#   campaign.txt     GPU, driver, jax/jaxlib/CUDA/cuDNN versions, then each run's start and exit
#   layer.json       one MoE layer fwd+bwd vs dense FFN, N=2,4,8,16: ragged (XLA's lowering),
#                    padded, and ragged with the Pallas/Triton grouped lowering where jax has it;
#                    part "grouped" adds run "grouped_ffn": the expert FFN alone (fwd+bwd, bf16,
#                    32,768 rows, emb 512, mlp 2048, N=2,4,8,16): dense, padded, grouped (Mosaic
#                    GPU kernels, sm90 only), capacity 1.0 and 1.25 (experiments/bench_grouped.py)
#   step.json        whole training step: throughput + MFU (dense vs N=4), SparseMixer/Switch
#                    overhead and the routers alone at N=2,4,8,16; default config (dispatch auto);
#                    with ROUTERS set, also runs "router_cost_layer" and "router_cost": those
#                    routers against Switch, one MoE layer and the whole step, N=4 and 8;
#                    part "lm" adds run "lm_throughput_cudnn" (with LM_ROUTERS, one run
#                    "lm_throughput_cudnn_<router>" per router): the decoder-only language
#                    model's update at configs/lm_bench.py's sizes (hidden 2048, 16 layers,
#                    65,536 tokens in 2 micro-batches of 8 sequences, bf16, cuDNN attention),
#                    MoE (8 experts, top-2, grouped) vs dense of equal active parameters, and
#                    each router vs top-2, with model FLOPs and MFU; part "lm_profile" adds
#                    "lm_cudnn" to profile.json: where that update's device time goes (with
#                    LM_DOCUMENT_MASKS, both parts run once per way of passing the documents'
#                    mask to cuDNN, the name ending in it: "_bias", "_offsets", "_causal");
#                    part "routing" adds run "routing_options": each routing option's update
#                    (sigmoid, bias balancing, global/sequence loss, groups, a shared expert)
#                    against the plain router, Transformer-base N=4, 2 x 4,096 tokens
#                    (experiments/bench_routing_options.py)
#   variants.json    throughput with cuDNN flash attention, unsafe_rbg dropout PRNG, both,
#                    deterministic GPU ops (its cost), the one-call vs three-call update, and
#                    (part "flags") two XLA:GPU flags
#   profile.json     device time per GPU kernel category (N=4, default config and fast variant)
#   profile.trace.json.gz  the default config's trace (Perfetto / TensorBoard)
#   decode.json      beam search (beam 4) sentences/s, Multi30k-test and newstest-like batches
#   tests.txt        the test files that run on GPU, with JAX_PLATFORMS=cuda,cpu (the Mosaic
#                    GPU interpreter's callbacks need a CPU device; the GPU is the default)
# Each JSON holds {"runs": {name: the benchmark's JSON}}; print its tables with
#     python -m experiments.benchmark --report $OUT/step.json
#
# Python packages the GPU machine lacks, or has at other versions than requirements.txt pins
# (ml_collections, sacremoses, tensorboardX; flax, optax, orbax-checkpoint, chex): installed from
# ./.whl when present, for a machine without PyPI access. Where PyPI is reachable:
#   pip download --no-deps -d .whl ml_collections==1.1.0 sacremoses==0.2.0 tensorboardX==2.6.5 \
#     flax==0.12.10 optax==0.2.8 orbax-checkpoint==0.12.8 chex==0.1.92
set -uo pipefail

OUT=${OUT:-runs/gpu_campaign}
REPEATS=${REPEATS:-10}
RUN_LIMIT=${RUN_LIMIT:-560}  # seconds; one run past it is stopped and the campaign goes on
# (the longest run, "routing", takes about 9 min on an H200: see above)
PLATFORM=${PLATFORM:-cuda}  # PLATFORM=cpu BENCH_ARGS="--emb 16 ..." checks the script on a CPU
BENCH_ARGS=${BENCH_ARGS:-}  # appended to every benchmark run (e.g. smaller sizes)
GROUPED_ARGS=${GROUPED_ARGS:-}  # appended to the grouped part (on a CPU: "--interpret --tiny --experts 2")
ROUTING_ARGS=${ROUTING_ARGS:-}  # appended to the routing part (on a CPU: "--emb 32 --mlp 64 ...")
ROUTERS=${ROUTERS:-}  # e.g. "sparsemixer densemixer default_moe": part "step" times them against Switch
LM_ROUTERS=${LM_ROUTERS:-}  # e.g. "sparsemixer_v2 densemixer": part "lm" times each against top-2
# e.g. "bias offsets causal": part "lm" runs once per way cuDNN's attention gets the documents
# (python -m experiments.benchmark --lm-document-mask), each run named with it: what the mask costs
LM_DOCUMENT_MASKS=${LM_DOCUMENT_MASKS:-}
# e.g. "mosaic mosaic_2wg": parts "lm" and "lm_profile" run once per grouped-matmul kernel
# (python -m experiments.benchmark --lm-grouped-impl), each run named with it
LM_GROUPED_IMPLS=${LM_GROUPED_IMPLS:-}
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(env lm routing lm_profile layer grouped step variants flags profile decode tests)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
if ! command -v python >/dev/null && command -v python3 >/dev/null; then
  # Images with only python3 (a wrapper, not a link: a linked venv python loses its venv).
  mkdir -p "$WORK/bin"
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$WORK/bin/python"
  chmod +x "$WORK/bin/python"
  PATH="$WORK/bin:$PATH"
fi
export JAX_PLATFORMS=$PLATFORM
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/sparsemixer_campaign_cache}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ -d .whl ]; then
  for w in .whl/*.whl; do python -m pip install -q --no-index --no-deps "$w" >/dev/null 2>&1 || true; done
fi
python -c "import ml_collections" || { echo "ml_collections is missing (see the header)"; exit 1; }

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/campaign.txt" >&2; }

# bench PART NAME ARGS...: one benchmark run, merged into $OUT/PART.json under NAME at once.
bench() {
  local part=$1 name=$2
  shift 2
  log "$part/$name: python -m experiments.benchmark $*"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  timeout "$RUN_LIMIT" python -m experiments.benchmark --backend "$PLATFORM" --repeats "$REPEATS" \
    --out "$WORK/$part.$name.json" "$@" $BENCH_ARGS 2>&1 | tail -n 40 >>"$WORK/$part.$name.log"
  log "$part/$name: exit ${PIPESTATUS[0]}"
  merge "$part" "$name"
}

# merge PART NAME: $WORK/PART.NAME.json (or the tail of its log) into $OUT/PART.json under NAME.
merge() {
  local part=$1 name=$2
  python - "$OUT/$part.json" "$name" "$WORK/$part.$name.json" "$WORK/$part.$name.log" <<'EOF'
import json, os, sys
path, name, result, logfile = sys.argv[1:]
merged = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
if os.path.exists(result):
    merged["runs"][name] = json.load(open(result))
else:  # stopped or failed: keep its last lines
    merged["runs"][name] = {"failed": open(logfile).read()[-4000:]}
json.dump(merged, open(path, "w"), indent=1)
EOF
}

for part in "${PARTS[@]}"; do
  case $part in
    env)
      { nvidia-smi; python -c "import jax; jax.print_environment_info(); print(jax.devices())"
        python -c "from sparsemixer_jax.kernels import triton_ragged_dot as g; print('triton ragged_dot kernels:', g.triton_ragged_dot_available())"
        pip list 2>/dev/null | grep -i -E "jax|nvidia|flax|optax|orbax"; } >>"$OUT/campaign.txt" 2>&1
      ;;
    layer)
      bench layer xla_lowering --sections moe_vs_dense --experts 2 4 8 16
      if python -c "from sparsemixer_jax.kernels import triton_ragged_dot as g; exit(not g.triton_ragged_dot_available())"; then
        bench layer triton_ragged_dot --sections moe_vs_dense --experts 2 4 8 16 \
          --layer-dispatches ragged --triton-ragged-dot
      else
        log "layer/triton_ragged_dot: skipped, this jax lacks the Pallas/Triton ragged_dot kernels"
      fi
      ;;
    grouped)
      # Its own script (not experiments.benchmark); merged into layer.json to keep to 8 files.
      log "layer/grouped_ffn: python -m experiments.bench_grouped"
      # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
      timeout "$RUN_LIMIT" python -m experiments.bench_grouped --repeats "$REPEATS" \
        --json "$WORK/layer.grouped_ffn.json" $GROUPED_ARGS 2>&1 | tail -n 60 \
        | tee "$WORK/layer.grouped_ffn.log" >>"$OUT/campaign.txt"
      log "layer/grouped_ffn: exit ${PIPESTATUS[0]}"
      merge layer grouped_ffn
      # The whole training step with the grouped dispatch (targets: N=4 >= 0.90x dense tokens/s,
      # N=4 MFU >= 30%, SparseMixer / Switch <= 1.01); into step.json beside the default.
      bench step throughput_grouped --sections throughput --dispatch grouped
      bench step overhead_grouped --sections overhead --experts 4 --dispatch grouped
      ;;
    step)
      bench step throughput --sections throughput
      bench step overhead --sections overhead router --experts 2 4 8 16
      if [ -n "$ROUTERS" ]; then  # two runs, each within RUN_LIMIT (8 whole models compile)
        # shellcheck disable=SC2086  # ROUTERS is a list of words
        bench step router_cost_layer --sections layer_cost --experts 4 8 --routers $ROUTERS
        # shellcheck disable=SC2086
        bench step router_cost --sections overhead --experts 4 8 --routers $ROUTERS
      fi
      ;;
    routing)
      # Each routing option's cost per update of Transformer-base N = 4 against the plain router
      # (target on one H100: at most 1% each); into step.json. Its own script, like "grouped".
      # Its lines go to campaign.txt as they come (each option's build time, then every round's
      # step times), so that a run stopped from outside still shows its rounds.
      log "step/routing_options: python -m experiments.bench_routing_options"
      # shellcheck disable=SC2086  # ROUTING_ARGS is a list of words
      timeout "$RUN_LIMIT" python -m experiments.bench_routing_options --emb 512 --mlp 2048 \
        --layers 6 --experts 4 --tokens 4096 --length 128 --vocab 32000 --steps 10 \
        --repeats 5 --json "$WORK/step.routing_options.json" $ROUTING_ARGS 2>&1 \
        | tee "$WORK/step.routing_options.log" >>"$OUT/campaign.txt"
      log "step/routing_options: exit ${PIPESTATUS[0]}"
      merge step routing_options
      ;;
    lm)
      # The language model's whole training step at configs/lm_bench.py's sizes (hidden 2048,
      # 16 layers, sequences of 4,096, 65,536 tokens an update in 2 micro-batches of 8 rows,
      # bf16): the MoE model (8 experts, top-2, grouped dispatch) against its dense twin of equal
      # active parameters, and each router of LM_ROUTERS against top-2 (targets on one H100: MoE
      # >= 0.85x the dense tokens/s, dense >= 45% MFU, SparseMixer-v2 / top-2 <= 1.01); into
      # step.json. Every arm of a run holds its train state (the MoE model's 21 GiB, the dense
      # twin's 8) while the others run, and a micro-batch of 8 rows needs about 33 GiB more
      # (experiments.compile for h200:1x1): top-2, one more router and dense fit an H200
      # (143 GiB), four arms do not (they ran out of memory at commit c06cbc4), and three are
      # over an H100's 80 GiB. So each router gets a run of its own, top-2 and dense timed again
      # beside it. (The einsum attention, measured at commit
      # 566fd23 against cuDNN's, needs one-row micro-batches, which the benchmark takes from
      # the config.)
      routers=("$LM_ROUTERS")
      masks=("$LM_DOCUMENT_MASKS")
      impls=("$LM_GROUPED_IMPLS")
      # shellcheck disable=SC2206  # LM_ROUTERS, LM_DOCUMENT_MASKS, LM_GROUPED_IMPLS: word lists
      [ -n "$LM_ROUTERS" ] && routers=($LM_ROUTERS)
      # shellcheck disable=SC2206
      [ -n "$LM_DOCUMENT_MASKS" ] && masks=($LM_DOCUMENT_MASKS)
      # shellcheck disable=SC2206
      [ -n "$LM_GROUPED_IMPLS" ] && impls=($LM_GROUPED_IMPLS)
      for router in "${routers[@]}"; do
        for mask in "${masks[@]}"; do
          for impl in "${impls[@]}"; do
            # shellcheck disable=SC2086  # empty: no router flag, top-2 and dense alone
            XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} \
              bench step "lm_throughput_cudnn${router:+_$router}${mask:+_$mask}${impl:+_$impl}" \
              --sections lm_throughput --lm-config configs/lm_bench.py:moe \
              ${router:+--lm-routers $router} ${mask:+--lm-document-mask $mask} \
              ${impl:+--lm-grouped-impl $impl}
          done
        done
      done
      ;;
    lm_profile)
      # Where the LM update's device time goes (cuDNN attention), into profile.json.
      masks=("$LM_DOCUMENT_MASKS")
      impls=("$LM_GROUPED_IMPLS")
      # shellcheck disable=SC2206  # LM_DOCUMENT_MASKS and LM_GROUPED_IMPLS are lists of words
      [ -n "$LM_DOCUMENT_MASKS" ] && masks=($LM_DOCUMENT_MASKS)
      # shellcheck disable=SC2206
      [ -n "$LM_GROUPED_IMPLS" ] && impls=($LM_GROUPED_IMPLS)
      for mask in "${masks[@]}"; do
        for impl in "${impls[@]}"; do
          rm -rf "$WORK/trace_lm"
          # shellcheck disable=SC2086  # empty: no flag, the config's mask and kernels
          bench profile "lm_cudnn${mask:+_$mask}${impl:+_$impl}" --sections lm_profile \
            --lm-config configs/lm_bench.py:moe --profile-dir "$WORK/trace_lm" --repeats 1 \
            ${mask:+--lm-document-mask $mask} ${impl:+--lm-grouped-impl $impl}
        done
      done
      ;;
    variants)
      bench variants cudnn_attention --sections throughput --attention-impl cudnn
      bench variants unsafe_rbg --sections throughput --rng-impl unsafe_rbg
      bench variants cudnn_unsafe_rbg --sections throughput --attention-impl cudnn --rng-impl unsafe_rbg
      bench variants deterministic --sections throughput --deterministic
      bench variants fusion --sections fusion --experts 4
      ;;
    flags)
      # XLA:GPU flags an entry point could set, if they pay: cuBLAS for every matmul instead of
      # XLA's Triton GEMM fusions, and the latency-hiding scheduler.
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
        bench variants no_triton_gemm --sections throughput
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true" \
        bench variants latency_hiding_scheduler --sections throughput
      ;;
    profile)
      rm -rf "$WORK/trace_default" "$WORK/trace_fast"
      bench profile default --sections profile --profile-dir "$WORK/trace_default" --repeats 1
      bench profile cudnn_unsafe_rbg --sections profile --profile-dir "$WORK/trace_fast" \
        --attention-impl cudnn --rng-impl unsafe_rbg --repeats 1
      trace=$(find "$WORK/trace_default" -name "*.trace.json.gz" | head -n 1)
      # Some remote runners return files of at most 16 MiB.
      if [ -n "$trace" ] && [ "$(stat -c %s "$trace")" -lt 16000000 ]; then
        cp "$trace" "$OUT/profile.trace.json.gz"
      fi
      ;;
    decode)
      # Compile time is reported apart: no persistent cache, so it is a real compilation.
      (unset JAX_COMPILATION_CACHE_DIR; bench decode beam4 --sections decode --experts 4 --repeats 3)
      ;;
    tests)
      # The GPU the default backend, the CPU beside it: the Mosaic GPU interpreter's io_callbacks
      # need a CPU device. Tests that take the CPU's 8 simulated devices (tests/conftest.py) as
      # the default ones skip on a GPU host.
      platforms=$PLATFORM
      [ "$PLATFORM" != cpu ] && platforms=$PLATFORM,cpu
      log "tests: JAX_PLATFORMS=$platforms pytest (GPU subset)"
      JAX_PLATFORMS=$platforms timeout "$RUN_LIMIT" python -m pytest -q -n 0 -p no:cacheprovider \
        tests/test_routing.py tests/test_moe.py tests/test_models.py tests/test_decode.py \
        tests/test_exact_gradient.py tests/test_steps.py tests/test_triton_ragged_dot.py \
        tests/test_gpu.py tests/test_train.py tests/test_grouped_ffn.py tests/test_lm_attention.py \
        tests/test_compute_copies.py >"$OUT/tests.txt" 2>&1
      log "tests: exit $? ($(tail -n 1 "$OUT/tests.txt"))"
      ;;
    *) log "unknown part $part (env lm routing lm_profile layer grouped step variants flags profile decode tests)" ;;
  esac
done
log "done: $OUT"
