#!/usr/bin/env bash
# The anchor-task experiments of README "Results" (issue 9, item 6). Resumable like cpu_lm.sh:
# every sweep skips its finished points. Each run is config/anchor_gamma1.py's (2 layers, d 64,
# 4,680 steps, lr 1e-3) with the named changes; its held-out pair is scored by eval.py bench.
#   bash results/anchor.sh [SECTION ...]   # default: every section of ALL below, in order; 3-8 min per run on one core
#   VARIANTS="keyfirst keylast" bash results/anchor.sh robust   # some of the robustness variants
set -uo pipefail  # no -e: a failed point (or sweep) must not stop the later sweeps
cd "$(dirname "$0")/.."
# compile: blocks under torch.compile run these small models ~1.8x faster (~30 s to compile).
SWEEP="python sweep.py config/anchor_gamma1.py --eval anchor --set compile=True --jobs ${JOBS:-1}"
anchor_data() {  # anchor_data NAME [prepare_data.py anchor options]: data/NAME, made once
    local out=data/$1; shift
    [ -f $out/meta.json ] || python prepare_data.py anchor --out $out "$@"
}
ALL="data phase robust ablate width_lr confirm layout layout_bench report confirm_report"
all_anchor_data() {  # every data set of the sections below: the tuned task and the robustness variants
    anchor_data anchor
    anchor_data anchor_heldout24 --heldout 2,4 --mirror-shift -5
    anchor_data anchor_heldout13 --heldout 1,3 --mirror-shift 8
    anchor_data anchor_len15 --seq-len 15
    anchor_data anchor_keyfirst --key-positions 0-0
    anchor_data anchor_keylast --key-positions 6-6
}
SECTIONS=${*:-$ALL}
SHARES=heldout_inferential,heldout_symmetric  # the held-out answer shares the reports plot and list by seed
made() { [ -s "$1" ]; }  # an analysis whose output exists is not redone
CONFIRM_SEEDS=100,101,102,103,104,105  # results/confirm.md: seeds no exploration run has used

for section in $SECTIONS; do case $section in
data)
    # Generated from seed 0, so an existing folder is checked rather than rebuilt; any difference
    # from results/data.json stops the script (exit 1).
    all_anchor_data || exit 1
    for name in anchor anchor_heldout24 anchor_heldout13 anchor_len15 anchor_keyfirst anchor_keylast; do
        python results/data_check.py data/$name $name || exit 1
    done
    ;;
phase)
    # Phase diagram: depth x γ with ε=1e-12 and the gate held (only γ and depth move), 2 seeds
    # (a seed is the init draw and the data order; the data set is data/anchor's seed 0).
    anchor_data anchor
    $SWEEP --name anchor_phase --grid model.n_layer=1,2,3,4 --grid gamma=0.3,0.5,0.75,1.0,1.25 --seeds 0,1
    ;;
robust)
    # Robustness of the recipe-vs-baseline contrast beyond the tuned task, 3 seeds each:
    # other held-out pairs (their mirror trained with a shift that is no pair's composite:
    # the composites are 10, 6, 3, 2, -1, -3, -4, -7, -10, -16) and a longer sequence (15 inputs:
    # the key at any of 13 positions instead of 7), and the key at one fixed position: first
    # (6 fillers between the pair and the answer) or last (the pair right before the answer).
    all_anchor_data
    for variant in ${VARIANTS:-heldout24 heldout13 len15 keyfirst keylast}; do
        extra=$([ $variant = len15 ] && echo "--set seq_len=15")
        $SWEEP --name anchor_$variant --arm recipe= --arm baseline=config/_baseline.py --seeds 0,1,2 \
            --set data_dir=data/anchor_$variant $extra
    done
    ;;
ablate)
    # Which part of the recipe makes the task compose, on the tuned task (data/anchor), 3 seeds:
    # γ=1 alone (ε=1e-5, no gate), the two settings alone (γ=0.5, ε=1e-12, gate), the recipe
    # without its gate, and the baseline with matrix decay 1.0 (does decay alone make γ=0.5 compose?).
    anchor_data anchor
    $SWEEP --name anchor_ablate --seeds 0,1,2 --arm recipe= --arm baseline=config/_baseline.py \
        --arm gamma1_only=config/_baseline.py,gamma=1.0 --arm settings_only=,gamma=0.5 \
        --arm no_gate=,model.attn_gate=none --arm baseline_wd1=config/_baseline.py,weight_decay.matrix=1.0
    ;;
width_lr)
    # The search's two outcomes that the README quoted from its private harness, rerun here:
    # γ=1's inferential answers weakened at d_model 128 and were fragile at lr 3e-3. Both arms,
    # 3 seeds; the lr arms first (they take half as long).
    anchor_data anchor
    $SWEEP --name anchor_width_lr --seeds 0,1,2 \
        --arm recipe_lr3e-3=,lr=3e-3 --arm baseline_lr3e-3=config/_baseline.py,lr=3e-3 \
        --arm recipe_d128=,model.d_model=128 --arm baseline_d128=config/_baseline.py,model.d_model=128
    ;;
confirm)
    # results/confirm.md, claim 7: the tuned task, both arms, seeds never run in the exploration;
    # claim 8: the layout map's headline cell (length 9, the key in the first 5 positions).
    anchor_data anchor
    $SWEEP --name confirm_anchor --seeds $CONFIRM_SEEDS --arm recipe= --arm baseline=config/_baseline.py
    anchor_data anchor_len9_first --key-positions 0-4
    python results/data_check.py data/anchor_len9_first anchor_len9_first || exit 1
    $SWEEP --name confirm_layout --seeds $CONFIRM_SEEDS --set data_dir=data/anchor_len9_first --set seq_len=9 \
        --arm recipe= --arm baseline=config/_baseline.py
    ;;
layout)
    # Issue 24, item 4: where does the contrast hold? Sequence length {9, 12, 15} x the key's window
    # {anywhere it fits, the first 5 positions, the last 5}, both arms, 3 seeds, in one sweep whose
    # arms are {recipe,baseline}_len{N}_{window}. The key is at position p, the held-out pair at p+1
    # and p+2, the answer after the last input: the window sets the distance between pair and answer.
    # Columns in turn (key first, then last: the outside check's layout was a long sequence with the
    # key first), the new anywhere cell, then the two cells that ran before with these seeds (len 9
    # anywhere: anchor_ablate's recipe and baseline; len 15 anywhere: anchor_len15), as reruns.
    arms=()
    for cell in 9:first 15:first 12:first 9:last 15:last 12:last 12:any 9:any 15:any; do
        n=${cell%:*} window=${cell#*:}
        case $window in
        any) data=$([ $n = 9 ] && echo anchor || echo anchor_len$n); kp=() ;;
        first) data=anchor_len${n}_first; kp=(--key-positions 0-4) ;;
        last) data=anchor_len${n}_last; kp=(--key-positions $((n - 7))-$((n - 3))) ;;
        esac
        anchor_data $data $([ $n = 9 ] || echo --seq-len $n) "${kp[@]}" || exit 1
        python results/data_check.py data/$data $data || exit 1
        arms+=(--arm recipe_len${n}_$window=,data_dir=data/$data,seq_len=$n
               --arm baseline_len${n}_$window=config/_baseline.py,data_dir=data/$data,seq_len=$n)
    done
    $SWEEP --name anchor_layout --seeds 0,1,2 "${arms[@]}"
    ;;
layout_bench)
    # The layout map's runs and claim 7's, scored again by today's eval.py bench (their rows were
    # scored when they ran): shares on trained keys, and the answer position's attention to the key
    # and the pair by layer (the mechanism). One JSON per finished run in results/anchor_bench/.
    for sweep in anchor_layout confirm_anchor; do
        mkdir -p results/anchor_bench/$sweep
        for run in out/sweeps/$sweep/*/; do
            point=$(basename $run)
            [ -s $run/sweep_point.json ] || continue  # not finished
            data=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['data_dir'])" $run/config.json)
            made results/anchor_bench/$sweep/$point.json || python eval.py bench $run --task anchor --data $data \
                --json-out results/anchor_bench/$sweep/$point.json > /dev/null
        done
    done
    python results/anchor_layout.py
    ;;
report)
    python eval.py report results/anchor_phase.json --plot-x gamma --plot-y model.n_layer \
        --plot-metric $SHARES --per-seed heldout_inferential --out results/report_anchor_phase.md
    python eval.py report results/anchor_{heldout24,heldout13,len15,keyfirst,keylast}.json \
        --plot-x arm --plot-metric $SHARES --per-seed $SHARES \
        --out results/report_anchor_robust.md
    python eval.py report results/anchor_ablate.json --plot-x arm --plot-metric $SHARES \
        --per-seed $SHARES --out results/report_anchor_ablate.md
    python eval.py report results/anchor_width_lr.json --plot-x arm --plot-metric $SHARES \
        --per-seed $SHARES --out results/report_anchor_width_lr.md
    python results/anchor_layout.py  # the layout map: report_anchor_layout.md, anchor_layout.png
    ;;
confirm_report)
    # results/confirm.md, claims 7 and 8: s = inferential - symmetric share per run, recipe - baseline by seed.
    for claim in anchor layout; do
        c=results/confirm_$claim.json
        made $c && python eval.py report $c --plot-metric $SHARES --per-seed $SHARES \
            --pair $c:baseline $c:recipe --pair-metric heldout_margin --out results/report_confirm_$claim.md
    done
    ;;
*) echo "unknown section $section: one of $ALL" >&2; exit 2 ;;
esac; done
