#!/usr/bin/env bash
# The translation comparison under the paper's initialisation (model.init=fairseq), on
# configs/multi30k_compare.py (N = 4), in phases that each resume where they stopped:
#
#     ROOT=runs/init_study bash experiments/init_study.sh            # every phase, in order
#     ROOT=runs/init_study bash experiments/init_study.sh main long  # some phases
#
# Phases (runs of 8-20 minutes each on 2 CPU cores, PARALLEL at a time, default 2):
#   main   Switch, SparseMixer, DenseMixer, Default MoE under the paper's scheme, seeds 0-4
#          (500 updates): ROOT/main
#   long   Switch and SparseMixer, 1,500 updates, seeds 0-2: ROOT/long
#   split  Switch and SparseMixer from the earlier flax scheme with one component drawn as the
#          paper's code draws it (router, experts, dense FFNs), seeds 0-2: ROOT/split_<component>
#   summary  the tables of every phase (markdown and JSON) into ROOT
# The reference for the split is docs/results/successors_multi30k_cpu.json (the same config under
# the flax scheme, seeds 0-6). Finished runs keep only their small files (--compact); pack them
# for another machine with
#     python -m experiments.compare --root ROOT/main --arms ... --seeds ... --summarize-only \
#         --pack main.tar.gz
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${ROOT:-runs/init_study}"
PARALLEL="${PARALLEL:-2}"
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(main long split summary)

compare() { python -m experiments.compare --no-dense --parallel "$PARALLEL" --compact "$@"; }
MAIN_ARMS=(switch_n4 sparsemixer_n4 densemixer_n4 default_moe_n4)
PAIR=(switch_n4 sparsemixer_n4)

for phase in "${phases[@]}"; do
  case "$phase" in
    main)
      compare --root "$ROOT/main" --arms "${MAIN_ARMS[@]}" --seeds 0 1 2 3 4 \
        --override model.init=fairseq ;;
    long)
      compare --root "$ROOT/long" --arms "${PAIR[@]}" --seeds 0 1 2 --steps 1500 \
        --override model.init=fairseq ;;
    split)
      for component in router experts ffn; do
        compare --root "$ROOT/split_$component" --arms "${PAIR[@]}" --seeds 0 1 2 \
          --override "model.init=flax,$component=fairseq"
      done ;;
    summary)
      compare --root "$ROOT/main" --arms "${MAIN_ARMS[@]}" --seeds 0 1 2 3 4 --summarize-only \
        --out-json "$ROOT/main.json" --out-md "$ROOT/main.md" --plot "$ROOT/main.png"
      compare --root "$ROOT/long" --arms "${PAIR[@]}" --seeds 0 1 2 --steps 1500 \
        --summarize-only --out-json "$ROOT/long.json" --out-md "$ROOT/long.md" \
        --plot "$ROOT/long.png"
      for component in router experts ffn; do
        compare --root "$ROOT/split_$component" --arms "${PAIR[@]}" --seeds 0 1 2 \
          --summarize-only --out-json "$ROOT/split_$component.json" \
          --out-md "$ROOT/split_$component.md" --plot "$ROOT/split_$component.png"
      done ;;
    *) echo "init_study.sh: unknown phase '$phase' (main, long, split, summary)" >&2; exit 2 ;;
  esac
done
