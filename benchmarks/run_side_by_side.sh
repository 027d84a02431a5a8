#!/usr/bin/env bash
# The side-by-side comparison on the reference GPU machine (GPU_MACHINE.md), from the checkout root:
#
#   bash benchmarks/run_side_by_side.sh [CONTENDERS]     # default dense,resident,deepspeed,sliding
#
# Llama-3.2-3B shape (random init), seq 1024, micro-batch 8, grad-accum 1/4/8 (8K/32K/64K tokens
# per step), VRAM cap 24 GiB on deepspeed and sliding, 2 warm-up + 5 timed steps, and the largest
# micro-batch under the cap. Writes $OUT/side_by_side.{json,md,log} and one log per contender
# ($OUT: the device call's output folder; ./runs/side_by_side elsewhere).
# With deepspeed among the contenders it needs .whl/ (carry it): the DeepSpeed 0.19.8 sdist and the
# wheels of hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions
# (GPU_MACHINE.md says how to download them); it installs them into .site/ once per machine. The
# image has ninja and a compiler for DeepSpeed's CPU Adam JIT build (cached in .build/).
#
# Runtime estimate (step times from earlier runs on that machine):
#   deepspeed  install ~0.5 min; init + CPU Adam JIT ~2 min; steps 7 x (2.3 + 5.9 + ~11) s
#              ~2.3 min; largest micro-batch: 10 (7 steps, ~20 s), 12 (out of memory at once)  ~5.5 min
#   dense      model build ~0.3 min; steps 7 x (0.5 + 1.9 + 3.8) s ~0.7 min                   ~1 min
#   resident   host state ~0.5 min; steps 7 x (1.4 + 2.6 + 4.2) s ~1 min                       ~1.5 min
#   sliding    as resident, plus the planner's largest micro-batch (7 steps) and 25% more (2)  ~2.2 min
#   all four ~10 min (measured 2026-11-29: 9.0 min): more than one 600 s device call. Split it in two calls and merge the two
#   result files anywhere (no GPU needed):
#     bash benchmarks/run_side_by_side.sh deepspeed                # carry .whl; ~5.5 min
#     bash benchmarks/run_side_by_side.sh dense,resident,sliding   # ~4.5 min
#     python3 benchmarks/side_by_side.py --merge A/side_by_side.json B/side_by_side.json --out DIR/side_by_side
# TIMEOUT (seconds per contender, default 480) ends a hung contender before the call's own limit,
# so the records it made so far are still written.
set -euo pipefail
CONTENDERS=${1:-dense,resident,deepspeed,sliding}
OUT=${OUT:-$PWD/runs/side_by_side}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ ",$CONTENDERS," == *",deepspeed,"* ]]; then
  S=$PWD/.site
  if [ ! -d "$S/deepspeed" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$S" .whl/*.whl
    mkdir -p .build && tar xzf .whl/deepspeed-0.19.8.tar.gz -C .build
    (cd .build/deepspeed-0.19.8 &&
      DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --target "$S" .)
  fi
  export PYTHONPATH=$PYTHONPATH:$S TORCH_EXTENSIONS_DIR=$PWD/.build/torch_extensions
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -u benchmarks/side_by_side.py --shape llama-3.2-3b --seq 1024 --micro-batch 8 \
  --grad-accum 1 4 8 --vram-cap 24 --contenders "$CONTENDERS" --max-batch \
  --timeout "${TIMEOUT:-480}" --out "$OUT/side_by_side" 2>&1 | tee "$OUT/side_by_side.log"
