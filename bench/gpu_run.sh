#!/usr/bin/env bash
# Issue #16's GPU measurements in one device call (the device tool allows 10 minutes a
# call and 30 a session, so one call must carry everything). Run from the repository root
# on the GPU machine, after `bash bench/gpu_prepare.sh` here, a first call that copied
# .gpu/hf (the tokenizer stack as tested) and .gpu/tok (tokenizer.json etc. of the converted
# test model) to /root/stage, and a second that copied .gpu/part-a there (and .gpu/spy,
# py-spy's wheel, for the steps that sample with it); this call carries .gpu/part-b,
# .gpu/wheels and .gpu/SHA256SUMS (64 MiB a call, the tree included). Without
# /root/stage/hf the image's own transformers runs:
#
#   bash bench/gpu_run.sh [STEPS]  # STEPS: any of host,kernels,attention,save,prefill,batch,long,ready,restore,
#                                  # restore8,quant,throughput,composed,gather,nocache,profile,speed,agents,70b,quant70b,kept,
#                                  # change,graphs,readyspy,weights,decodehost,matmulhost,compiled,malloc,graphknobs,
#                                  # matmulab,spypass,capture,startloop,hit,build,ahead,ahead70b,aheadf32,
#                                  # aheadf16,ahead8,firstab,hfab,pack
#   BITS="8 4" SIZES=8K,32K bash bench/gpu_run.sh quant70b   # which KV precisions and sizes
#   OMLX_PROFILE=nvidia-h100 bash bench/gpu_run.sh throughput  # the omlx profile (default nvidia-h200)
#                                  # (default: host,kernels,ready,restore)
#
# Everything lands in $OUT (JSON per bench in results.tgz, the server logs in logs.tgz). Each
# step runs under its own time limit (STEP_S, default 540 s) sent to the bench itself, so that it stops its servers;
# servers a cut-off earlier call left behind are stopped first (they held 37 GB of the GPU
# once). One model is kept on the 64 GiB disk at a time (the 70B one takes 36 GiB).
set -u
STEPS=${1:-host,kernels,ready,restore}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -f /tmp/site/.done ]; then  # reassemble the MLX CUDA wheel and install all
  cp .gpu/part-b/* .gpu/SHA256SUMS /root/stage/ || exit 1
  (cd /root/stage && cat mlx_cuda_13-*.whl.part-* > "$(basename "$(ls mlx_cuda_13-*.part-aa)" .part-aa)" \
     && sha256sum -c SHA256SUMS) || exit 1
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/stage/*.whl .gpu/wheels/*.whl \
    && touch /tmp/site/.done || exit 1
fi
[ -d .gpu/tok ] || { mkdir -p .gpu && cp -r /root/stage/tok .gpu/tok; } || exit 1  # staged by the first call
if [ -d /root/stage/hf ] && [ ! -f /tmp/site-hf/.done ]; then  # the tokenizer stack as tested (gpu_prepare.sh)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-hf /root/stage/hf/*.whl && touch /tmp/site-hf/.done
fi
TESTED=  # the tested stack ahead of the image's, where it was staged and imports
if [ -f /tmp/site-hf/.done ]; then
  if PYTHONPATH=/tmp/site-hf:/tmp/site:$PWD python3 -c "import appliance, mlx_lm.utils" 2> "$OUT/tested-stack.txt"; then
    TESTED=/tmp/site-hf:
  else
    echo "the tested tokenizer stack does not import here; the image's runs:"; tail -3 "$OUT/tested-stack.txt"
  fi
fi
stack_path() { echo "$([ "$1" = tested ] && echo "$TESTED")/tmp/site:$PWD"; }  # PYTHONPATH: the image's stack or the tested one
export PYTHONPATH=$(stack_path tested)
STEP_S=${STEP_S:-540}
OMLX_PROFILE=${OMLX_PROFILE:-nvidia-h200}  # the omlx profile every step's servers run under (nvidia-h100 on an H100)
pkill -f "[a]ppliance serve" ; pkill -f "[m]lx_lm.server" ; sleep 1  # left by a cut-off call
rm -rf /tmp/omlx-bench-* /tmp/omlx-restore-*  # their cache dirs
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h /tmp | tail -1
step() { timeout -k 20 "$STEP_S" "$@"; }  # SIGTERM to the bench: it stops its servers
model() {  # model 8b | 70b: generates it unless there; removes the other
  case $1 in
    8b) rm -rf /tmp/llama-70b-4bit
        [ -d /tmp/llama-8b ] || python3 bench/gpu_model.py --shape 8b --out /tmp/llama-8b --tokenizer .gpu/tok ;;
    70b) rm -rf /tmp/llama-8b
         [ -d /tmp/llama-70b-4bit ] || python3 bench/gpu_model.py --shape 70b --bits 4 --out /tmp/llama-70b-4bit \
           --tokenizer .gpu/tok ;;
  esac
}
python3 - <<'PY' | tee "$OUT/startup.txt"
import time; t0 = time.perf_counter()
import appliance  # first, as `omlx serve` does (it keeps transformers from importing PyTorch)
import mlx.core as mx; t1 = time.perf_counter()
mx.eval(mx.zeros(1) + 1); t2 = time.perf_counter()
import mlx_lm.utils; t3 = time.perf_counter()
import appliance.runtime, appliance.server.runner; t4 = time.perf_counter()
import transformers
print(f"import mlx.core {t1-t0:.2f} s, first eval {t2-t1:.2f} s, mlx_lm.utils {t3-t2:.2f} s, "
      f"omlx server {t4-t3:.2f} s; transformers {transformers.__version__} from {transformers.__file__}")
PY
if [ -n "$TESTED" ]; then  # mlx-lm's imports under each stack, a fresh process each (2.6-3.4 s on some hosts)
  for stack in image tested image tested; do
    PYTHONPATH=$(stack_path $stack) python3 -X importtime \
      -c "import appliance, mlx.core, mlx_lm.utils" 2> "$OUT/importtime-$stack.txt"
    echo "the $stack stack: $(grep -E '\| +(transformers|mlx_lm.utils)$' "$OUT/importtime-$stack.txt" \
      | awk -F'|' '{printf "%s %.2f s; ", $3, $2 / 1e6}' | tr -s ' ')" | tee -a "$OUT/startup.txt"
  done
fi
case ",$STEPS," in *,capture,*)  # a second thread's work against MLX's graph capture (kernels/gate.py);
  # CAPTURE_JOBS: bench/capture_race.py's jobs, "+gate" ones as the server runs them
  step python3 bench/capture_race.py --beside "${CAPTURE_JOBS:-none,pin,pinfree,kvwarm,selftest,readback,h2d,meminfo}" \
    --repeats "${CAPTURE_REPEATS:-2}" --seconds 6 2>&1 | tee "$OUT/capture.jsonl" ;; esac
case ",$STEPS," in *,host,*)
  step python3 bench/host_path.py --shape 8b --tokens 25417 --out "$OUT/host_path.json" 2>&1 | tail -40 ;; esac
case ",$STEPS," in *,kernels,*)
  step python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kv_move.py tests/kernels/test_registry.py \
    tests/kernels/test_nvrtc.py tests/kernels/test_cubins.py tests/kernels/test_cuda_driver.py tests/kernels/test_packs.py tests/models/test_weights.py::test_on_cuda_every_tensor_is_copied_bit_for_bit tests/models/test_weights.py::test_on_cuda_a_read_failing_midway_falls_back_to_mx_load \
    tests/models/test_fuse.py::test_a_bfloat16_model_with_a_kv_cache_fuses_to_the_same_logits tests/kernels/test_small_matmul.py tests/models/test_native_linear.py::test_on_cuda_a_model_with_a_kv_cache_computes_the_same_logits_natively 2>&1 | tail -30 ;; esac
case ",$STEPS," in *,attention,*)  # what a new attention shape costs (cuDNN graphs)
  step python3 bench/attention_graphs.py --shape 8b --out "$OUT/attention_graphs.json" 2>&1 | tail -20 ;; esac
case ",$STEPS," in *,save,*)
  step python3 bench/save_step.py --shape 8b --tokens 25417 --out "$OUT/save_step.json" | tail -80 ;; esac
case ",$STEPS," in *,prefill,*)
  # every run a new prompt length, as users send them; omlx first, so mlx-lm finds its graphs built
  step python3 bench/prefill_paths.py --shape 8b --tokens 25417 --tokenizer .gpu/tok --new-lengths \
    --paths engine,generate_step,engine_cache --out "$OUT/prefill_paths.json" 2>&1 | grep -v '  phases' | tail -40 ;; esac
case ",$STEPS," in *,batch,*)  # item 5: one wave of N short prompts, omlx's engine against BatchGenerator
  # (BATCH_ARGS: more arguments, e.g. "--shared-prefix 31 --busy-share 0.5")
  step python3 bench/batch_steps.py --shape 8b --n 8,32 --tokenizer .gpu/tok --out "$OUT/batch_steps.json" \
    --paths "${BATCH_PATHS:-batch_generator,engine,engine_cache,engine_cache_nowrite,engine_stagger}" ${BATCH_ARGS:-} 2>&1 \
    | grep -v '"phases"' | tail -60 ;; esac
case ",$STEPS," in *,change,*)  # what a batch's change of rows costs, in process, from an empty kernel cache
  # (CHANGE_ARGS: e.g. "--rows 8" without --warm-up, to see the kernels the warm-up compiles)
  rm -rf /tmp/omlx-change-tmp && mkdir -p /tmp/omlx-change-tmp
  TMPDIR=/tmp/omlx-change-tmp step python3 bench/batch_change.py --shape 8b --tokenizer .gpu/tok \
    ${CHANGE_ARGS:---rows 8,32 --warm-up} --out "$OUT/batch_change.json" 2>&1 | cut -c1-600 | tail -10 ;; esac
case ",$STEPS," in *,graphs,*)  # the same decode pass at two speeds (8-10 or 14-18 ms at 8 rows on an H100):
  # batch_change with MLX's CUDA graphs off, then on, the GPU's clocks, power and throttle reasons sampled each second
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -l 1 > "$OUT/clocks.csv" & smi=$!
  for graphs in 0 1; do
    MLX_USE_CUDA_GRAPHS=$graphs step python3 bench/batch_change.py --shape 8b --tokenizer .gpu/tok --rows 8,32 \
      --out "$OUT/batch_change-graphs$graphs.json" 2>&1 | cut -c1-400 | tail -8
  done
  kill $smi ;; esac
case ",$STEPS," in *,decodehost,*)  # item 5: where an N-row decode pass's time goes on the host (build, submit,
  # wait), in variants (DECODE_ARGS); then padded against fused at 8 rows with MLX's CUDA graphs off
  step python3 bench/decode_host.py --shape 8b --tokenizer .gpu/tok ${DECODE_ARGS:---rows 1,8,32} \
    --out "$OUT/decode_host.json" 2>&1 | cut -c1-420 | tail -60
  MLX_USE_CUDA_GRAPHS=0 step python3 bench/decode_host.py --shape 8b --tokenizer .gpu/tok --rows 8 \
    --variants padded,fused --out "$OUT/decode_host-nographs.json" 2>&1 | cut -c1-420 | tail -8 ;; esac
case ",$STEPS," in *,matmulhost,*)  # item 5: what one matmul costs MLX CUDA's host, by rows (an upstream repro)
  step python3 bench/matmul_host.py ${MATMUL_ARGS:-} --out "$OUT/matmul_host.json" 2>&1 | tail -12 ;; esac
case ",$STEPS," in *,long,*)  # item 5: short requests during a long prefill, in process, each step traced
  step python3 bench/long_and_shorts.py --shape 8b --tokenizer .gpu/tok --out "$OUT/long_and_shorts.json" 2>&1 \
    | tail -150 ;; esac
case ",$STEPS," in *,ready,*)
  model 8b
  # A fresh cache dir: the weights are seen for the first time (their fingerprint hashed).
  # Empty JIT caches make a start a machine's first; one in MLX's default kernel cache
  # fills it where a fresh machine has it empty; then two later starts: imports profiled,
  # and with the warm-up after the load instead of beside it (its parts unshared).
  ready() { step python3 bench/start_to_ready.py /tmp/llama-8b --profile "$OMLX_PROFILE" --tokens 25000 "$@" 2>&1 \
    | grep -E '"(start_to_ready|model_load|stand_in_warm_up|stand_in_end_after_load|process_to_first_log_line|warm_up|weights_preload|weights_preloaded_after_start|memory_hit_median)_s"|warmed up|preload'; }
  ready --fresh-kernel-caches --out "$OUT/ready.json"
  ready --out "$OUT/ready-default.json"
  ready --import-profile --out "$OUT/ready-later.json"
  ready --stand-in off --out "$OUT/ready-later-no-stand-in.json" ;; esac
case ",$STEPS," in *,build,*)  # item 3: a restored prefix's batch cache built per layer against runs of layers
  for shape in ${BUILD_SHAPES:-8b}; do
    step python3 bench/build_cache.py --shape "$shape" --tokens ${BUILD_TOKENS:-31232} --out "$OUT/build-cache-$shape.json"
  done ;; esac
case ",$STEPS," in *,hit,*)  # item 3: what a 32K memory hit adds at the client: the prompt's encoding, one call
  # against pieces (bench/encode_pieces.py); then one-token chats against a short one's in HIT_RUNS starts (default 2,
  # the first filling MLX's kernel cache where the machine is fresh)
  model 8b
  step python3 bench/encode_pieces.py .gpu/tok --tokens ${HIT_TOKENS:-30000} --out "$OUT/encode-pieces.json" 2>&1 \
    | grep -v 'Token indices' | cut -c1-400
  for run in $(seq ${HIT_RUNS:-2}); do
    for code in ${HIT_CODES:-.}; do  # HIT_CODES: checkouts whose servers take turns (an A/B), e.g. ". .ab/OLD"
      echo "run $run, code $code"
      step python3 bench/start_to_ready.py /tmp/llama-8b --profile "$OMLX_PROFILE" --tokens ${HIT_TOKENS:-30000} \
        --code "$code" --out "$OUT/hit-$run$([ "$code" = . ] || echo "-$(basename "$code")").json" 2>&1 \
        | grep -E '"start_to_ready_s"|"label"|memory_hit_median' | cut -c1-300
    done
  done ;; esac
case ",$STEPS," in *,startloop,*)  # STARTS starts in a row with [kernels] STARTLOOP_KERNELS (default
  # small_matmul = "generic", the setting a server once aborted in at start: docs/GPU.md, "Work beside a stream
  # capture"); each start's time to ready, or what ended it
  model 8b
  for i in $(seq "${STARTS:-6}"); do
    step python3 bench/start_to_ready.py /tmp/llama-8b --profile "$OMLX_PROFILE" --tokens 2000 --max-tokens 8 \
      --kernels "${STARTLOOP_KERNELS:-small_matmul = \"generic\"}" --out "$OUT/startloop-$i.json" 2>&1 \
      | grep -E '"start_to_ready_s"|terminate|what\(\)|Error' | head -5
    echo "start $i: exit ${PIPESTATUS[0]}"
  done ;; esac
manifest() { echo "appliance/kernels/ahead/mlx-$(python3 -c 'import mlx.core as mx; print(mx.__version__)').json"; }
first_start() {  # first_start MODEL_DIR TOKENS [start_to_ready.py args]: a start with empty kernel caches
  step python3 bench/start_to_ready.py "$1" --profile "$OMLX_PROFILE" --tokens "$2" --fresh-kernel-caches \
    --hit-repeats 1 "${@:3}" 2>&1 | grep -E '"(start_to_ready|model_load|warm_up|weights_preload)_s"|ahead|warmed up'
}
case ",$STEPS," in *,firstab,*)  # item 1: the 8B's first starts (empty kernel caches) with the trees of FIRSTAB_CODE
  # (default .ab/OLD, carried: other commits' code, small enough to carry beside the wheels, each made by
  # `git archive REV appliance profiles pyproject.toml | tar -x -C .ab/NAME`) and this tree, in turn and back:
  # A B B A, or with two of them A B C C B A
  model 8b
  W=/tmp/omlx-firstab; rm -rf "$W"; i=0
  codes="${FIRSTAB_CODE:-.ab/OLD} ."
  for code in $codes $(echo "$codes" | tr ' ' '\n' | tac); do
    i=$((i + 1)); name=$([ "$code" = . ] && echo this || basename "$code"); echo "start $i: $name"
    first_start /tmp/llama-8b 4000 --code "$code" --work "$W/$i" --out "$OUT/firstab-$i-$name.json"
  done ;; esac
case ",$STEPS," in *,hfab,*)  # item 1: the 8B's first starts with the image's tokenizer stack against the tested
  # one (gpu_prepare.sh's .gpu/hf, staged by a call of its own), in the order A B B A
  model 8b
  W=/tmp/omlx-hfab; rm -rf "$W"; i=0
  [ -n "$TESTED" ] || echo "hfab: no tested stack imports here; every start runs the image's"
  for stack in image tested tested image; do
    i=$((i + 1)); echo "start $i: the $stack stack"
    PYTHONPATH=$(stack_path $stack) first_start /tmp/llama-8b 4000 --work "$W/$i" --out "$OUT/hfab-$i-$stack.json"
  done ;; esac
case ",$STEPS," in *,ahead,*)  # item 1: MLX's kernels compiled ahead (appliance/kernels/ahead.py) on a machine's
  # first start. Unless AHEAD_KEEP is set, a first start without a manifest records one from what MLX compiled
  # (into this tree and $OUT); then the manifest compiled into an empty dir 16 at once (and one at a time with
  # AHEAD_SERIAL=1), compared with MLX's own, and a first start and a later one with it.
  model 8b
  W=/tmp/omlx-ahead; rm -rf "$W"; mkdir -p "$W/aside"
  M=$(manifest)
  ahead_ready() { first_start /tmp/llama-8b 25000 "$@"; }
  if [ -z "${AHEAD_KEEP:-}" ]; then
    [ -f "$M" ] && mv "$M" "$W/aside/"
    ahead_ready --work "$W/mlx" --out "$OUT/ahead-mlx.json"
    [ -f "$W/aside/${M##*/}" ] && mv "$W/aside/${M##*/}" "$M"  # what MLX compiled merges into it
    python3 bench/kernels_ahead.py record "$W/mlx/ptx" --model /tmp/llama-8b --out "$M" && cp "$M" "$OUT/"
  fi
  step python3 bench/kernels_ahead.py compile "$W/ours" --model /tmp/llama-8b --workers 16 \
    | tee "$OUT/ahead-compile-16.json" | tail -4
  [ -n "${AHEAD_SERIAL:-}" ] && step python3 bench/kernels_ahead.py compile "$W/one" --model /tmp/llama-8b \
    --workers 1 | tee "$OUT/ahead-compile-1.json" | tail -4
  [ -d "$W/mlx/ptx" ] && python3 bench/kernels_ahead.py compare "$W/mlx/ptx" "$W/ours" | tee "$OUT/ahead-compare.json"
  if [ -n "${AHEAD_KEEP:-}" ]; then  # ours with MLX's flags alone (the same as MLX's, in earlier runs) against ours
    step python3 bench/kernels_ahead.py compile "$W/plain" --model /tmp/llama-8b --mlx-flags \
      | tee "$OUT/ahead-compile-plain.json" | tail -4
    python3 bench/kernels_ahead.py compare "$W/plain" "$W/ours" | tee "$OUT/ahead-compare-plain.json"
  fi
  ahead_ready --work "$W/first" --out "$OUT/ahead-first.json"
  ahead_ready --work "$W/first" --out "$OUT/ahead-later.json"
  ls "$W/first/ptx" | head -40 ;; esac
case ",$STEPS," in *,ahead70b,*)  # item 1 for the 70B shape at 4 bits: a first start with the manifest (its
  # quantized matmuls compiled ahead for its kinds of weights), what MLX compiled beside merged into the manifest
  # (this tree and $OUT: nothing new, where the manifest holds all a first start needs), then a later start
  model 70b
  W=/tmp/omlx-ahead70; rm -rf "$W"
  M=$(manifest)
  ready70() { first_start /tmp/llama-70b-4bit 4000 "$@"; }
  ready70 --work "$W/first" --out "$OUT/ahead70-first.json"
  python3 bench/kernels_ahead.py record "$W/first/ptx" --model /tmp/llama-70b-4bit --out "$M" && cp "$M" "$OUT/"
  ready70 --work "$W/first" --out "$OUT/ahead70-later.json" ;; esac
ahead_model() {  # ahead_model SHAPE DTYPE [BITS]: item 1 for a model of other kinds of weights than the 8B's: a
  # first start with MLX compiling what the manifest holds none of for it, what MLX compiled merged into the
  # manifest (this tree and $OUT), then a first start with it
  F=/tmp/llama-$1-$2${3:+-$3bit}; N=${F#/tmp/llama-}
  [ -d "$F" ] || python3 bench/gpu_model.py --shape "$1" --dtype "$2" ${3:+--bits "$3"} --out "$F" \
    --tokenizer .gpu/tok | tail -1
  W=/tmp/omlx-ahead-$N; rm -rf "$W"
  M=$(manifest)
  first_start "$F" 4000 --work "$W/mlx" --out "$OUT/ahead-$N-mlx.json"
  python3 bench/kernels_ahead.py record "$W/mlx/ptx" --model "$F" --out "$M" && cp "$M" "$OUT/"
  first_start "$F" 4000 --work "$W/first" --out "$OUT/ahead-$N-first.json"
  rm -rf "$F"
}
case ",$STEPS," in *,pack,*)  # item 1: the shipped pack of MLX's kernels (appliance/kernels/packs.py, built without a
  # GPU): its cubins against MLX's own (compiled by a first start with the manifest aside, which takes the pack with
  # it), then first starts from it: the 8B in bfloat16 and at 8 bits
  model 8b
  W=/tmp/omlx-pack; rm -rf "$W"; mkdir -p "$W/aside"
  M=$(manifest); mv "$M" "$W/aside/"
  first_start /tmp/llama-8b 4000 --work "$W/mlx" --out "$OUT/pack-mlx.json"
  mv "$W/aside/${M##*/}" "$M"
  python3 bench/kernels_ahead.py unpack "$W/pack" && python3 bench/kernels_ahead.py compare "$W/mlx/ptx" "$W/pack" \
    | tee "$OUT/pack-compare.json"
  first_start /tmp/llama-8b 4000 --work "$W/first" --out "$OUT/pack-first.json"
  F=/tmp/llama-8b-bfloat16-8bit
  [ -d "$F" ] || python3 bench/gpu_model.py --shape 8b --bits 8 --out "$F" --tokenizer .gpu/tok | tail -1
  first_start "$F" 4000 --work "$W/first8" --out "$OUT/pack-first8.json"
  rm -rf "$F" ;; esac
# a float32 model (a GGUF source converts to float32 on a GPU: the quick start's model), a float16 one, an 8-bit one
case ",$STEPS," in *,aheadf32,*) ahead_model 1b float32 ;; esac
case ",$STEPS," in *,aheadf16,*) ahead_model 1b float16 ;; esac
case ",$STEPS," in *,ahead8,*) ahead_model 8b bfloat16 8 ;; esac
case ",$STEPS," in *,readyspy,*)  # item 1: a later start (after `ready`) sampled by py-spy, every thread, native
  # frames too: where the stand-in's chats spend their seconds beside the load (bench/spy_threads.py
  # ready-spy.txt --native --match warm_up_stand_in)
  model 8b
  step /tmp/site/bin/py-spy record --subprocesses --threads --idle --native -r 100 -f raw -o "$OUT/ready-spy.txt" \
    -- python3 bench/start_to_ready.py /tmp/llama-8b --profile "$OMLX_PROFILE" --tokens 25000 \
    --out "$OUT/ready-spy.json" 2>&1 | grep -E '"(start_to_ready|model_load|stand_in_warm_up)_s"|warmed up'
  python3 bench/spy_threads.py "$OUT/ready-spy.txt" --native --match warm_up_stand_in --top 20 2>&1 | tail -60 ;; esac
case ",$STEPS," in *,weights,*)  # a model's load: mx.load against pinned reads and a copy kernel
  model 8b
  step python3 bench/weight_load.py /tmp/llama-8b --beside-imports --out "$OUT/weight_load.json" 2>&1 | tail -14 ;; esac
case ",$STEPS," in *,kept,*)  # item 1: kernels kept in the cache dir survive what a reboot does to /tmp
  model 8b
  rm -rf /tmp/omlx-kept
  step python3 bench/start_to_ready.py /tmp/llama-8b --profile "$OMLX_PROFILE" --tokens 25000 \
    --work /tmp/omlx-kept --kernels-in-cache-dir --out "$OUT/ready-kept-first.json" 2>&1 | tail -25
  rm -rf "/tmp/mlx"  # MLX's default kernel cache, as a reboot empties a tmpfs /tmp
  step python3 bench/start_to_ready.py /tmp/llama-8b --profile "$OMLX_PROFILE" --tokens 25000 \
    --work /tmp/omlx-kept --kernels-in-cache-dir --out "$OUT/ready-kept-later.json" 2>&1 | tail -25 ;; esac
case ",$STEPS," in *,restore,*)
  model 8b
  # (RESTORE_ARGS: more arguments, e.g. "--ssd-kv-bits 4")
  step python3 bench/restore.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --sizes "${RESTORE_SIZES:-8K,25K}" --host \
    --ssd-repeats 1 ${RESTORE_ARGS:-} --out "$OUT/restore.json" 2>&1 | tail -45 ;; esac
case ",$STEPS," in *,restore8,*)  # the SSD tier at 8 bits (issue #11)
  model 8b
  step python3 bench/restore.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --sizes "${RESTORE_SIZES:-8K,25K}" \
    --ssd-kv-bits 8 --ssd-repeats 1 --out "$OUT/restore8.json" 2>&1 | tail -12 ;; esac
case ",$STEPS," in *,quant,*)  # issue #11: host and SSD tiers at 16, 8 and 4 bits, 8K and 32K
  model 8b
  for bits in ${BITS:-16 8 4}; do
    step python3 bench/restore.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --sizes ${SIZES:-8K,32K} --host \
      --tiers-only --host-kv-bits $bits --ssd-kv-bits $bits --ssd-repeats 1 --out "$OUT/quant$bits.json" 2>&1 | tail -8
  done ;; esac
omlx_ab() {  # omlx_ab NAME ARGS...: item 5's A/Bs, omlx alone over HTTP at N = 8 and 32 (AB_N) with ARGS for
  # bench/throughput.py, each step traced (throughput-NAME.json, steps-NAME.jsonl)
  local name=$1; shift
  model 8b
  mkdir -p bench/out/logs
  OMLX_STEP_TRACE=$PWD/bench/out/logs/steps-$name.jsonl \
  step python3 bench/throughput.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --only a ${AB_N:---n 8 --n 32} \
    --omlx-only "$@" --out "$OUT/throughput-$name.json" 2>&1 | tail -14
}
case ",$STEPS," in *,malloc,*)  # item 5: the server's glibc malloc tunables (platform.MALLOC_TUNABLES: one
  # arena) against glibc's default, in process (decode_host, each setting twice in turn) and over HTTP (omlx_ab)
  tuned=$(python3 -c "from appliance.platform import MALLOC_TUNABLES as t; print(':'.join(f'{k}={v}' for k, v in t.items()))")
  omlx_ab arena1  # the server sets the three tunables itself
  export GLIBC_TUNABLES=glibc.malloc.arena_max=64; omlx_ab arena64; unset GLIBC_TUNABLES
  for round in 0 1; do
    for setting in default "$tuned"; do
      name=$([ "$setting" = default ] && echo default || echo tuned)
      env $([ "$setting" = default ] || echo "GLIBC_TUNABLES=$setting") timeout -k 20 "$STEP_S" python3 \
        bench/decode_host.py --shape 8b --tokenizer .gpu/tok --rows 8 --rounds 1 --steps 150 --variants padded,native \
        --out "$OUT/decode_host-malloc-$name-$round.json" 2>&1 | grep '"variant"' | cut -c1-300
    done
  done ;; esac
case ",$STEPS," in *,graphknobs,*)  # item 5: MLX CUDA's graph settings against the native decode pass's periodic
  # slow passes (every ~5 passes, +7-12 ms in MLX's submit): in process, then over HTTP (KNOBS: env settings)
  for knob in ${KNOBS:-default MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_MAX_OPS_PER_BUFFER=400 MLX_USE_CUDA_GRAPHS=0}; do
    env $([ "$knob" = default ] || echo "$knob") timeout -k 20 "$STEP_S" python3 bench/decode_host.py --shape 8b \
      --tokenizer .gpu/tok --rows 8 --rounds 1 --steps 300 --variants native --out "$OUT/decode_host-${knob//=/-}.json" 2>&1 \
      | grep '"variant"' | cut -c1-330
  done
  for knob in ${AB_KNOBS:-MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_USE_CUDA_GRAPHS=0}; do
    export "$knob"; omlx_ab "${knob//=/-}"; unset "${knob%%=*}"
  done ;; esac
case ",$STEPS," in *,matmulab,*)  # item 5: the few-row matmuls over HTTP, each in turn with batch_generate at
  # N = 8 and 32: MLX's (generic), ours (native), chosen from measured passes (auto); MATMULS: which
  for kernel in ${MATMULS:-generic native auto}; do
    omlx_ab "matmul-$kernel" --mlx-lm-batch-beside --omlx-server mlx_memory_limit_gb=44 \
      --omlx-kernels "small_matmul = \"$kernel\""
  done ;; esac
case ",$STEPS," in *,spypass,*)  # item 5: where the host's time goes in 8-row decode passes, ours against MLX's
  # matmuls: decode_host sampled by py-spy with native frames (4 ms), one process a variant; summed per library
  model 8b
  for variant in native fused; do
    step /tmp/site/bin/py-spy record --threads --native -r ${SPY_RATE:-250} -f raw -o "$OUT/spy-pass-$variant.txt" -- python3 \
      bench/decode_host.py --shape 8b --tokenizer .gpu/tok --rows 8 --rounds 1 --steps ${SPY_STEPS:-150} \
      --variants $variant --out "$OUT/decode_host-spy-$variant.json" 2>&1 | grep '"variant"' | cut -c1-330
    python3 bench/spy_threads.py "$OUT/spy-pass-$variant.txt" --native --threads 2 --top 25 > "$OUT/spy-pass-$variant.sum"
    head -70 "$OUT/spy-pass-$variant.sum"
  done
  (cd "$OUT" && tar czf spy-pass.tgz spy-pass-*.txt spy-pass-*.sum && rm -f spy-pass-*.txt spy-pass-*.sum) ;; esac
case ",$STEPS," in *,throughput,*)  # issue #16 item 5: N = 1, 8, 32, 64 against mlx_lm.server and batch_generate;
  # short requests during a 25K-token prefill (THROUGHPUT_ARGS replaces --mlx-lm-batch: "--only b --omlx-only";
  # on an 80 GB H100 "--only a --one-at-a-time --mlx-lm-batch": side by side N = 64 runs out of memory;
  # batch_generate in turn with the servers: "--only a --one-at-a-time --mlx-lm-batch-beside --omlx-server
  # mlx_memory_limit_gb=44", no spaces in a line: THROUGHPUT_ARGS is split on them; THROUGHPUT_NAME names the
  # files, e.g. for a second run in the same call with --omlx-kernels small_matmul=\"native\")
  model 8b
  mkdir -p bench/out/logs
  name=${THROUGHPUT_NAME:-throughput}
  OMLX_STEP_TRACE=$PWD/bench/out/logs/steps-$name.jsonl \
  step python3 bench/throughput.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" ${THROUGHPUT_ARGS:---mlx-lm-batch} \
    --out "$OUT/$name.json" 2>&1 | tail -40 ;; esac
case ",$STEPS," in *,composed,*)  # short calls' attention composed (no cuDNN graphs)
  omlx_ab composed --omlx-batching 'short_attention = "composed"' ;; esac
case ",$STEPS," in *,compiled,*)  # each Llama block's decode calls compiled (models/compiled_blocks.py)
  omlx_ab compiled --omlx-model 'compile_blocks = "on"' ;; esac
case ",$STEPS," in *,gather,*)  # an idle engine gathers arrivals ([batching] gather_ms, GATHER_MS)
  for ms in ${GATHER_MS:-5}; do omlx_ab gather-$ms --omlx-batching "gather_ms = $ms"; done ;; esac
case ",$STEPS," in *,nocache,*)  # no tier to store blocks in, so nothing restores before a start (over HTTP
  # each chat prompt restores its template's ~31 tokens from earlier requests' tail blocks)
  omlx_ab nocache --omlx-cache "memory_gb = 0" --omlx-cache "host_gb = 0" --omlx-cache "ssd_gb = 0" ;; esac
case ",$STEPS," in *,profile,*)  # item 5: where the server's threads hold the GIL at N = 8 and 32, sampled by
  # py-spy (raw stacks per thread, all processes: bench/spy_threads.py sums them); PROFILE_N, PROFILE_ARGS
  model 8b
  step /tmp/site/bin/py-spy record --subprocesses --threads -r 200 -f raw ${PROFILE_ARGS:---gil --nonblocking} \
    -o "$OUT/profile.txt" -- python3 bench/throughput.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --only a \
    ${PROFILE_N:---n 8 --n 32} --omlx-only --out "$OUT/throughput-profile.json" 2>&1 | tail -14 ;; esac
case ",$STEPS," in *,speed,*)  # item 3: the prefill speed a restore decision reads, after a lone prompt and a burst
  model 8b
  step python3 bench/prefill_speed.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --burst 32 \
    --out "$OUT/prefill_speed.json" 2>&1 | tail -6 ;; esac
case ",$STEPS," in *,agents,*)  # item 6: 32 contexts of 8K tokens, a restart halfway
  model 8b
  step python3 bench/agent_trace.py --model /tmp/llama-8b --profile "$OMLX_PROFILE" --out "$OUT/agent_trace.json" \
    2>&1 | tail -30 ;; esac
case ",$STEPS," in *,70b,*)  # item 4: the 70B-shaped model at 4 bits, 32K from host and SSD
  model 70b
  step python3 bench/restore.py --model /tmp/llama-70b-4bit --profile "$OMLX_PROFILE" --sizes 32K --host \
    --ssd-repeats 1 --out "$OUT/restore70b.json" 2>&1 | tail -20 ;; esac
case ",$STEPS," in *,quant70b,*)  # issue #11: the 70B shape's tiers at fewer bits (8 minutes a precision)
  model 70b
  for bits in ${BITS:-8 4}; do
    step python3 bench/restore.py --model /tmp/llama-70b-4bit --profile "$OMLX_PROFILE" --sizes ${SIZES:-8K,32K} --host \
      --tiers-only --host-kv-bits $bits --ssd-kv-bits $bits --ssd-repeats 1 --out "$OUT/quant70b-$bits.json" 2>&1 \
      | tail -8
  done ;; esac
[ -d bench/out/logs ] && tar czf "$OUT/logs.tgz" bench/out/logs
# The device returns at most 8 files a call: the JSON and the import profiles go back as one archive.
(cd "$OUT" && files=$(ls *.json importtime-*.txt tested-stack.txt 2>/dev/null; true) && [ -n "$files" ] \
  && tar czf results.tgz $files && rm -f $files)
