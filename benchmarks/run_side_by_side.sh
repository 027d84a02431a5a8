#!/usr/bin/env bash
# The side-by-side comparison on the reference GPU machine (GPU_MACHINE.md), from the checkout root:
#
#   bash benchmarks/run_side_by_side.sh [CONTENDERS]   # default dense,resident,deepspeed,slideformer,sliding
#   CAP="24 8" bash benchmarks/run_side_by_side.sh    # one table per cap (dense, resident: first only)
#
# Llama-3.2-3B shape (random init), seq 1024, micro-batch 8, grad-accum 1/4/8 (8K/32K/64K tokens
# per step; SlideFormer, which has no accumulation, runs micro-batch 8/32/64), VRAM cap $CAP GiB
# (default 24; a list runs the capped contenders once per cap) on deepspeed, slideformer and sliding, 2 warm-up + 5 timed steps, and the largest
# micro-batch under the cap. Writes $OUT/side_by_side_cap<CAP>.{json,md,log} and one log per contender
# ($OUT: the device call's output folder; ./runs/side_by_side elsewhere).
# With deepspeed among the contenders it needs .whl/ (carry it): the DeepSpeed 0.19.8 sdist and the
# wheels of hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions
# (GPU_MACHINE.md says how to download them); it installs them into .site/ once per machine. The
# image has ninja and a compiler for DeepSpeed's CPU Adam JIT build (cached in .build/).
# With slideformer it needs (both git-ignored, carry them): .contenders/SlideFormer, a checkout
# of github.com/RegiaYoung/SlideFormer (Apache-2.0; `git clone --depth 1
# https://github.com/RegiaYoung/SlideFormer .contenders/SlideFormer` on a machine with network)
# or only the files its offloader imports (a SOURCE.txt there names each one's commit),
# and in .whl/ the liger-kernel 0.6.5 wheel (`pip download --no-deps -d .whl liger-kernel==0.6.5`;
# SlideFormer's vendored fused linear-CE pins that API), installed into .site/ like DeepSpeed;
# its LayerAdam (C++ only, -march=native -fopenmp, AVX-512 when lscpu lists it; no nvcc) builds
# with the same compiler on first use, into ~/.cache/oom_optimizer (its loader's own build folder).
#
# Runtime estimate (step times from earlier runs on that machine):
#   deepspeed  install ~0.5 min; init + CPU Adam JIT ~2 min; steps 7 x (2.3 + 5.9 + ~11) s
#              ~2.3 min; largest micro-batch: 10 (7 steps, ~20 s), 12 (out of memory at once)  ~5.5 min
#   dense      model build ~0.3 min; steps 7 x (0.5 + 1.9 + 3.8) s ~0.7 min                   ~1 min
#   resident   host state ~0.5 min; steps 7 x (1.4 + 2.6 + 4.2) s ~1 min                       ~1.5 min
#   sliding    as resident, plus the planner's largest micro-batch (7 steps) and 25% more (2)  ~2.2 min
#   slideformer (not yet run by this script) random init on the CPU ~1 min, LayerAdam build ~1-2 min;
#              steps 7 x (1.6 + 1.9 + 2.9) s at 8K/32K/64K (its own figures of 2026-12-01)  ~3 min
#   all five ~13 min: more than one 600 s device call. Split it in calls and merge the result
#   files anywhere (no GPU needed):
#     bash benchmarks/run_side_by_side.sh deepspeed                # carry .whl; ~5.5 min
#     bash benchmarks/run_side_by_side.sh slideformer              # carry .whl .contenders; ~3 min
#     bash benchmarks/run_side_by_side.sh dense,resident,sliding   # ~4.5 min
#     python3 benchmarks/side_by_side.py --merge A/side_by_side_cap24.json B/side_by_side_cap24.json \
#       C/side_by_side_cap24.json --out DIR/side_by_side_cap24
#   and the same with CAP=8 for the capped contenders (side_by_side_cap8.*).
# MAX_BATCH=0 leaves out the largest micro-batch search. ACCUM (default "1 4 8") sets the grad-accum
# values, e.g. ACCUM="1 2" for 8K and 16K tokens per step.
# TIMEOUT (seconds per contender, default 480) ends a hung contender before the call's own limit,
# so the records it made so far are still written.
set -euo pipefail
CONTENDERS=${1:-dense,resident,deepspeed,slideformer,sliding}
CAP=${CAP:-24}
MAXB=--max-batch
[ "${MAX_BATCH:-1}" = 0 ] && MAXB=  # MAX_BATCH=0: no largest micro-batch search
OUT=${OUT:-$PWD/runs/side_by_side}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
S=$PWD/.site
if [[ ",$CONTENDERS," == *",slideformer,"* ]]; then
  if [ ! -d "$S/liger_kernel" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$S" .whl/liger_kernel-*.whl
  fi
  export PYTHONPATH=$PYTHONPATH:$S TORCH_EXTENSIONS_DIR=$PWD/.build/torch_extensions
fi
if [[ ",$CONTENDERS," == *",deepspeed,"* ]]; then
  if [ ! -d "$S/deepspeed" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$S" $(ls .whl/*.whl | grep -v liger_kernel)
    mkdir -p .build && tar xzf .whl/deepspeed-0.19.8.tar.gz -C .build
    (cd .build/deepspeed-0.19.8 &&
      DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --target "$S" .)
  fi
  export PYTHONPATH=$PYTHONPATH:$S TORCH_EXTENSIONS_DIR=$PWD/.build/torch_extensions
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
first=1
for cap in $CAP; do  # the uncapped contenders (dense, resident) run with the first cap only
  list=$CONTENDERS
  if [ -z "$first" ]; then
    list=$(echo ",$CONTENDERS," | sed -e 's/,dense,/,/g' -e 's/,resident,/,/g' -e 's/^,//' -e 's/,$//')
  fi
  first=
  [ -n "$list" ] || continue
  python3 -u benchmarks/side_by_side.py --shape llama-3.2-3b --seq 1024 --micro-batch 8 \
    --grad-accum ${ACCUM:-1 4 8} --vram-cap "$cap" --contenders "$list" $MAXB \
    --timeout "${TIMEOUT:-480}" --out "$OUT/side_by_side_cap$cap" 2>&1 | tee "$OUT/side_by_side_cap$cap.log"
done
