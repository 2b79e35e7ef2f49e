#!/usr/bin/env bash
# Issue #16's GPU measurements in one device call (the device tool allows 10 minutes a
# call and 30 a session, so one call must carry everything). Run from the repository root
# on the GPU machine, after `../shared/gpu/prepare-wheels.sh .gpu` here and a first call
# that copied .gpu/part-a to /root/stage; this call carries .gpu/part-b, .gpu/wheels,
# .gpu/SHA256SUMS and .gpu/tok (tokenizer.json etc. of the converted test model):
#
#   bash bench/gpu_run.sh [STEPS]  # STEPS: any of host,kernels,save,prefill,ready,restore,restore8,
#                                  # throughput,agents,70b
#                                  # (default: host,kernels,ready,restore)
#
# Everything lands in $OUT (JSON per bench, the server logs).
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
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 - <<'PY' | tee "$OUT/startup.txt"
import time; t0 = time.perf_counter()
import appliance  # first, as `omlx serve` does (it keeps transformers from importing PyTorch)
import mlx.core as mx; t1 = time.perf_counter()
mx.eval(mx.zeros(1) + 1); t2 = time.perf_counter()
import mlx_lm.utils; t3 = time.perf_counter()
import appliance.runtime, appliance.server.runner; t4 = time.perf_counter()
print(f"import mlx.core {t1-t0:.2f} s, first eval {t2-t1:.2f} s, mlx_lm.utils {t3-t2:.2f} s, "
      f"omlx server {t4-t3:.2f} s")
PY
python3 -X importtime -c "import appliance.runtime, appliance.server.runner" 2> "$OUT/importtime.txt"
sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -12
case ",$STEPS," in *,host,*)
  python3 bench/host_path.py --shape 8b --tokens 25417 --out "$OUT/host_path.json" 2>&1 | tail -40 ;; esac
case ",$STEPS," in *,kernels,*)
  python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kv_move.py tests/kernels/test_registry.py 2>&1 | tail -30 ;; esac
case ",$STEPS," in *,save,*)
  python3 bench/save_step.py --shape 8b --tokens 25417 --out "$OUT/save_step.json" | tail -80 ;; esac
case ",$STEPS," in *,prefill,*)
  python3 bench/prefill_paths.py --shape 8b --tokens 25417 --tokenizer .gpu/tok \
    --paths generate_step,engine,engine_cache --out "$OUT/prefill_paths.json" 2>&1 | tail -40 ;; esac
case ",$STEPS," in *,ready,*)
  [ -d /tmp/llama-8b ] || python3 bench/gpu_model.py --shape 8b --out /tmp/llama-8b --tokenizer .gpu/tok
  # A fresh cache dir: the weights are seen for the first time (their fingerprint hashed).
  python3 bench/start_to_ready.py /tmp/llama-8b --profile nvidia-h200 --tokens 25000 \
    --out "$OUT/ready.json" 2>&1 | tail -25 ;; esac
case ",$STEPS," in *,restore,*)
  [ -d /tmp/llama-8b ] || python3 bench/gpu_model.py --shape 8b --out /tmp/llama-8b --tokenizer .gpu/tok
  python3 bench/restore.py --model /tmp/llama-8b --profile nvidia-h200 --sizes "${RESTORE_SIZES:-8K,25K}" --host \
    --ssd-repeats 1 --out "$OUT/restore.json" 2>&1 | tail -45 ;; esac
case ",$STEPS," in *,restore8,*)  # the SSD tier at 8 bits (issue #11)
  python3 bench/restore.py --model /tmp/llama-8b --profile nvidia-h200 --sizes "${RESTORE_SIZES:-8K,25K}" \
    --ssd-kv-bits 8 --ssd-repeats 1 --out "$OUT/restore8.json" 2>&1 | tail -12 ;; esac
case ",$STEPS," in *,throughput,*)  # issue #16 item 5: N = 1, 8, 32, 64 against mlx_lm.server and batch_generate;
  # short requests during a 25K-token prefill
  [ -d /tmp/llama-8b ] || python3 bench/gpu_model.py --shape 8b --out /tmp/llama-8b --tokenizer .gpu/tok
  python3 bench/throughput.py --model /tmp/llama-8b --profile nvidia-h200 --mlx-lm-batch \
    --out "$OUT/throughput.json" 2>&1 | tail -40 ;; esac
case ",$STEPS," in *,agents,*)  # item 6: 32 contexts of 8K tokens, a restart halfway
  [ -d /tmp/llama-8b ] || python3 bench/gpu_model.py --shape 8b --out /tmp/llama-8b --tokenizer .gpu/tok
  python3 bench/agent_trace.py --model /tmp/llama-8b --profile nvidia-h200 --out "$OUT/agent_trace.json" \
    2>&1 | tail -30 ;; esac
case ",$STEPS," in *,70b,*)  # item 4: the 70B-shaped model at 4 bits, 32K from host and SSD
  [ -d /tmp/llama-70b-4bit ] || python3 bench/gpu_model.py --shape 70b --bits 4 --out /tmp/llama-70b-4bit \
    --tokenizer .gpu/tok
  python3 bench/restore.py --model /tmp/llama-70b-4bit --profile nvidia-h200 --sizes 32K --host \
    --ssd-repeats 1 --out "$OUT/restore70b.json" 2>&1 | tail -20 ;; esac
[ -d bench/out/logs ] && tar czf "$OUT/logs.tgz" bench/out/logs
