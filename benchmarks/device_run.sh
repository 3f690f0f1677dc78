#!/usr/bin/env bash
# Runs on a GPU machine without a Rust toolchain: no cargo there, so the library built here travels in
# .device/libdeepwell.so (copy it there). Steps, in order, as arguments (default: all):
#   info      GPU, torch, NVRTC
#   compile   python -m deepwell.cli.kernels --compile-all for the device's arch
#   tests     the whole pytest suite (GPU tests included)
#   quantize  benchmarks/bench_quantize.py        (quantize-quick: first shape only)
#   linear    benchmarks/bench_linear.py          (linear-quick: first shape only)
#   gemm      benchmarks/bench_gemm.py            (the fp8_block GEMMs alone; gemm-quick: fewer shapes)
#   gemm-tests the FP8 GEMM GPU tests (tests/ops/test_fp8_gemm.py -m gpu)
#   train     benchmarks/bench_train_step.py      (train-quick: 4 layers; train-8b: LLaMA-3-8B-shaped
#             layers, torchao tensorwise only)
#   mainjob   the README's main job (python -m deepwell) on the GPU
#   overhead  benchmarks/bench_overhead.py        (per-call host overhead on tiny inputs)
#   profile   benchmarks/profile_linear.py        (host vs kernel time of one layer's step)
#   torchao   installs a torchao wheel carried in .device/wheels/ (the machine has no network), so
#             the train and linear steps measure torchao float8 in the same process
#   moe       benchmarks/bench_moe.py             (moe-quick: the E64 layer only, no model step)
#   profile-moe benchmarks/profile_moe.py       (one MoE layer's kernel time by stage, HF grouped_mm vs
#             deepwell bf16, E64; profile-moe-all: the three bench_moe shapes; profile-moe-fp8: Mixtral and
#             E64 with deepwell fp8_block beside them)
#   parallel  benchmarks/bench_parallel.py        (1 vs 2 GPUs through torchrun: FSDP2 and tensor parallel;
#             needs a 2-GPU kind, nvidia-h200-x2; NVLink multicast stays off)
#   attention benchmarks/bench_attention.py       (an nn.MultiheadAttention transformer's train step: torch.compile
#             vs deepwell.optimize's SDPA swap; attention-quick: fewer steps and rounds)
#   before-after-linear / before-after-train  benchmarks/before_after.py: bench_linear.py (--shape 3) or
#             bench_train_step.py (--quick, no torchao) under .device/before/ (another commit's torch_ops/,
#             libdeepwell.so and benchmarks/) and this tree, interleaved, 2 rounds each; ~5 / ~8 min
#   moe-tests the MoE GPU tests (-m gpu; the CPU ones, HF parity included, run in CI against transformers 5.23)
# Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/deepwell-out}
mkdir -p "$OUT"
export DEEPWELL_LIBRARY=${DEEPWELL_LIBRARY:-$PWD/.device/libdeepwell.so}
export PYTHONPATH=$PWD/torch_ops${PYTHONPATH:+:$PYTHONPATH}
export DEEPWELL_CACHE_DIR=${DEEPWELL_CACHE_DIR:-/tmp/deepwell-jit}
RESULTS=benchmarks/results  # where the benchmarks write their JSON
export PYTHONUNBUFFERED=1
steps=${*:-info compile tests quantize}
status=0
for step in $steps; do
    echo "=== $step"
    case $step in
        info)
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
            python3 -c 'import torch, deepwell, deepwell._native as n; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), n.nvrtc_path())'
            ;;
        compile)
            python3 -m deepwell.cli.kernels --compile-all --arch sm_90a 2>&1 | tee "$OUT/compile.log" || status=1
            ;;
        tests)
            python3 -m pytest tests -p no:cacheprovider --maxfail=30 -rf 2>&1 | tee "$OUT/tests.log" | tail -60 || status=1
            ;;
        quantize | quantize-quick)
            quick=; [ "$step" = quantize-quick ] && quick=--quick
            python3 benchmarks/bench_quantize.py $quick 2>&1 | tee "$OUT/bench_quantize.log" || status=1
            cp "$RESULTS"/bench_quantize-*.json "$OUT/" 2>/dev/null
            ;;
        linear | linear-quick)
            quick=; [ "$step" = linear-quick ] && quick=--quick
            python3 benchmarks/bench_linear.py $quick 2>&1 | tee "$OUT/bench_linear.log" || status=1
            cp "$RESULTS"/bench_linear-*.json "$OUT/" 2>/dev/null
            ;;
        gemm | gemm-quick)
            quick=; [ "$step" = gemm-quick ] && quick=--quick
            python3 benchmarks/bench_gemm.py $quick 2>&1 | tee "$OUT/bench_gemm.log" || status=1
            cp "$RESULTS"/bench_gemm*.json "$OUT/" 2>/dev/null
            ;;
        before-after-linear | before-after-train)
            python3 benchmarks/before_after.py "${step#before-after-}" --out "$OUT" 2>&1 | tee "$OUT/$step.log" || status=1
            ;;
        gemm-tests)
            python3 -m pytest tests/ops/test_fp8_gemm.py -m gpu -p no:cacheprovider -x -rf 2>&1 | tee "$OUT/gemm_tests.log" | tail -40 || status=1
            ;;
        train | train-quick)
            quick=; [ "$step" = train-quick ] && quick=--quick
            python3 benchmarks/bench_train_step.py $quick 2>&1 | tee "$OUT/bench_train_step.log" || status=1
            cp "$RESULTS"/bench_train_step*.json "$OUT/" 2>/dev/null
            ;;
        train-8b)
            python3 benchmarks/bench_train_step.py --model 8b --torchao tensorwise 2>&1 | tee "$OUT/bench_train_step-8b.log" || status=1
            cp "$RESULTS"/bench_train_step*.json "$OUT/" 2>/dev/null
            ;;
        mainjob)
            run_dir=${MAINJOB_DIR:-/tmp/deepwell-mainjob}  # its checkpoints and plots stay on the machine
            (mkdir -p "$run_dir" && cd "$run_dir" && python3 -m deepwell) 2>&1 | tee "$OUT/mainjob.log" | tail -40 || status=1
            ;;
        profile)
            python3 benchmarks/profile_linear.py 2>&1 | tee "$OUT/profile_linear.log" || status=1
            cp "$RESULTS"/profile_linear*.json "$OUT/" 2>/dev/null
            ;;
        torchao)
            # Wheels sit next to the carried library (.device/wheels); the first that imports stays.
            for wheel in $(find "$(dirname "$DEEPWELL_LIBRARY")/wheels" -name 'torchao-*' 2>/dev/null | sort); do
                python3 -m pip install -q --no-deps "$wheel" && python3 -c 'import torchao.float8' && break
            done
            python3 -c 'import torchao; print("torchao", torchao.__version__)' || status=1
            ;;
        overhead)
            python3 benchmarks/bench_overhead.py 2>&1 | tee "$OUT/bench_overhead.log" || status=1
            cp "$RESULTS"/bench_overhead*.json "$OUT/" 2>/dev/null
            ;;
        moe | moe-quick)
            quick=; [ "$step" = moe-quick ] && quick=--quick
            python3 benchmarks/bench_moe.py $quick 2>&1 | tee "$OUT/bench_moe.log" || status=1
            find benchmarks/results -name "bench_moe-*.json" -exec cp {} "$OUT/" \;
            ;;
        profile-moe | profile-moe-all | profile-moe-fp8)
            shapes=fine-e64; [ "$step" = profile-moe-all ] && shapes="fine-e64 fine-e128 mixtral"
            recipe=; [ "$step" = profile-moe-fp8 ] && shapes="mixtral fine-e64" && recipe="--recipe fp8_block"
            for shape in $shapes; do
                python3 benchmarks/profile_moe.py --shape "$shape" $recipe 2>&1 | tee "$OUT/profile_moe-$shape${recipe:+-fp8_block}.log" || status=1
            done
            find benchmarks/results -name "profile_moe-*.json" -exec cp {} "$OUT/" \;
            ;;
        parallel)
            export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
            python3 benchmarks/bench_parallel.py --configs "${PARALLEL_CONFIGS:-1x4,1x8,2x8,2x4tp}" 2>&1 \
                | tee "$OUT/bench_parallel.log" | grep -v Warning || status=1
            cp "$RESULTS"/bench_parallel-*.json "$OUT/" 2>/dev/null
            ;;
        attention | attention-quick)
            quick=; [ "$step" = attention-quick ] && quick=--quick
            python3 benchmarks/bench_attention.py $quick 2>&1 | tee "$OUT/bench_attention.log" || status=1
            find benchmarks/results -name "bench_attention-*.json" -exec cp {} "$OUT/" \;
            ;;
        moe-tests)
            python3 -m pytest tests/ops/test_moe.py tests/nn/test_moe_module.py tests/ops/test_grouped_linear.py -m gpu \
                -p no:cacheprovider -rf 2>&1 | tee "$OUT/moe_tests.log" | tail -40 || status=1
            ;;
        *)
            echo "unknown step $step" >&2
            status=2
            ;;
    esac
done
exit $status
