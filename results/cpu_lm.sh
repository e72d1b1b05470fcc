#!/usr/bin/env bash
# The CPU language-model experiments of README "Results", in the order they ran. Resumable:
# every sweep skips its finished points, so rerunning this script after a kill continues.
# Each arm's lr is the best of an lr grid on seed 0 (by eval.py loss on the val split), chosen by
# best_lr below from the committed tuning results (every grid row is in results/*.json). The
# recipe-vs-baseline grid spans 1e-3..1e-1: on 1e-3..3e-2 the baseline's best was the 3e-2 edge.
# The γ sweep's per-γ grid is 1e-3..1e-1 too. A sweep whose finished point was run with other
# settings (e.g. a best lr that moved) stops with an error instead of reporting it.
#   bash results/cpu_lm.sh data   # data/bi_bytes from the offline kit in ../shared/data, checked against results/data.json
#   bash results/cpu_lm.sh [SECTION ...]   # default: every section of ALL below, in order; ~2 min per point
# Every section after lr reads the lr results it needs from results/*.json, so any one can be rerun.
set -uo pipefail  # no -e: a failed point (or sweep) must not stop the later sweeps
cd "$(dirname "$0")/.."
JOBS=${JOBS:-1}
BASE=config/cpu_lm.py
LRS=0.001,0.003,0.01,0.03,0.1
GAMMA_LRS=$LRS  # first run on 1e-3..3e-2 (time); extended to 1e-1 after γ<=0.75 had their best at 3e-2
WIDTH_LRS=0.0003,$LRS  # extended down after the recipe's best at width 256 was the 1e-3 edge
FINE_LRS=0.0017,0.0055,0.017,0.055  # LRS's geometric midpoints (lr_fine and gamma_fine)
HALF_LRS=0.001,0.0017,0.003,0.0055,0.01,0.017,0.03,0.055,0.1  # LRS and FINE_LRS merged (scale_wide)
WIDE_SIZES="96:648:65 128:1200:120"  # d_model:max_steps:warmup_steps (scale_wide)
# A sweep skips a point whose run folder holds sweep_point.json. On another machine (a fresh clone, a new session)
# the run folders are gone, but each finished point's row is committed in results/NAME.json, and that row is what
# its sweep_point.json held: written back, the point counts as finished again (sweep.py still checks it against the
# point's command), so a resumed section runs only what never finished and rewrites results/NAME.json whole.
sweep() {  # sweep --name NAME ARGS...: python sweep.py, after writing back NAME's committed rows
    python - "$2" <<'PY'
import json, os, sys
path = os.path.join("results", sys.argv[1] + ".json")
for row in json.load(open(path))["rows"] if os.path.exists(path) else []:
    marker = os.path.join(row["run_dir"], "sweep_point.json")
    if not os.path.exists(marker):
        os.makedirs(row["run_dir"], exist_ok=True)
        with open(marker, "w") as f:
            json.dump(row, f)
PY
    python sweep.py $BASE --jobs $JOBS "$@"
}
SWEEP=sweep
# The data: globs (written when a folder went through datasets' split inference and read one file of
# corpus/en's six; a folder is now read whole, but the study's recorded sources are these globs).
BI_BYTES="--tokenizer bytes --max-tokens 16M --source en=../shared/data/corpus/en/**/*.txt,weight=0.5
    --source zh=../shared/data/corpus/zh/four_classics/*.txt,weight=0.5"
made() { [ -s "$1" ]; }  # an analysis whose output exists is not redone (the script is rerun to resume)

best_lr() {  # best_lr RESULTS[,RESULTS...] ARM [KEY=VALUE]: the lr of the lowest eval loss among the arm's rows (with that setting)
    python - "$@" <<'PY'
import json, sys
paths, arm = sys.argv[1].split(","), sys.argv[2]
key, _, want = (sys.argv[3] if len(sys.argv) > 3 else "").partition("=")

def value(row):  # a grid/arm setting, else the resolved config (dotted keys into its dicts)
    if key in row["setting"]:
        return row["setting"][key]
    out = row["config"]
    for part in key.split("."):
        out = out[part]
    return out

rows = [r for path in paths for r in json.load(open(path))["rows"] if r["arm"] == arm and (not key or value(r) == float(want))]
print(min(rows, key=lambda r: r["eval"]["loss"]["summary"]["loss"])["setting"]["lr"])
PY
}

tuned_arms() {  # tuned_arms LR_RESULTS SUFFIX KEY=VALUE SETTINGS: "--arm recipe_SUFFIX=..." and the
    # baseline's, each with SETTINGS and its best lr among the LR_RESULTS rows with KEY=VALUE
    local arm file
    for arm in recipe baseline; do
        file=$([ $arm = baseline ] && echo config/_baseline.py)
        echo "--arm ${arm}_$2=$file,$4,lr=$(best_lr "$1" $arm "$3")"
    done
}

tuned_lrs() {  # R and B: the recipe's and the baseline's best lr of the lr section
    R=$(best_lr results/lr_tune.json recipe) && B=$(best_lr results/lr_tune.json baseline)
}

fine_lr() {  # fine_lr ARM: the arm's best lr over the lr section's grid and lr_fine's half steps
    best_lr results/lr_tune.json,results/lr_fine.json "$1"
}

near_best() {  # near_best ARM: "d:lr,..." at widths 32-256, every seed's best lr so far (lr_width_ARM
    # and lr_width_seeds_ARM) and its neighbours on WIDTH_LRS: rerun until it stops growing, every
    # seed's best is inside the lrs that ran
    python - "$1" "$WIDTH_LRS" <<'PY'
import json, os, sys
arm, grid = sys.argv[1], [float(v) for v in sys.argv[2].split(",")]
rows = [r for f in (f"results/lr_width_{arm}.json", f"results/lr_width_seeds_{arm}.json") if os.path.exists(f)
        for r in json.load(open(f))["rows"]]
out = []
for d in (32, 64, 128, 256):
    best = {}  # seed -> (loss, lr)
    for r in rows:
        if r["config"]["model"]["d_model"] == d:
            here = (r["eval"]["loss"]["summary"]["loss"], r["config"]["lr"])
            best[r["seed"]] = min(best.get(r["seed"], here), here)
    near = {i + step for i in {grid.index(lr) for _, lr in best.values()} for step in (-1, 0, 1)}
    out += [f"{d}:{grid[i]!r}" for i in sorted(near) if 0 <= i < len(grid)]
print(",".join(out))
PY
}

wide_lrs() {  # wide_lrs RESULTS ARM D LR,LR,...: the lrs to run for ARM at width D: the starting grid, then
    # while the seed-0 best sits on the edge of the lrs that ran (rows of RESULTS), its neighbour on HALF_LRS beyond it
    python - "$1" "$2" "$3" "$4" "$HALF_LRS" <<'PY'
import json, os, sys
path, arm, d = sys.argv[1], sys.argv[2], int(sys.argv[3])
start, grid = ([float(v) for v in a.split(",")] for a in sys.argv[4:6])
rows = [r for r in json.load(open(path))["rows"] if r["arm"] == arm and r["config"]["model"]["d_model"] == d] if os.path.exists(path) else []
ran = {grid.index(r["config"]["lr"]): r["eval"]["loss"]["summary"]["loss"] for r in rows}
lrs = sorted({grid.index(lr) for lr in start} | set(ran))
if set(ran) >= set(lrs):  # every lr asked for so far has run: extend past an edge best
    best = min(ran, key=ran.get)
    if best == lrs[0] and best > 0:
        lrs.insert(0, best - 1)
    if best == lrs[-1] and best + 1 < len(grid):
        lrs.append(best + 1)
print(",".join(repr(grid[i]) for i in lrs))
PY
}

tune_lr() {  # tune_lr NAME ARM=SETTINGS D LR,LR,LR: the arm's lr on seed 0 into results/NAME.json: the three
    # starting lrs, then a half step past the best while it sits on an edge (wide_lrs); D is its d_model
    local axis= next
    while :; do
        next=$(wide_lrs results/$1.json "${2%%=*}" $3 $4) || return 1
        [ "$axis" = "$next" ] && return 0
        axis=$next
        $SWEEP --name $1 --arm "$2" --seeds 0 --grid lr=$axis || return 1
    done
}

explored_mean() {  # explored_mean GRID ARM REST REST_ARM [D]: the mean eval loss over seeds 0-2: seed 0 at ARM's
    # best lr in GRID (at width D), seeds 1 and 2 as REST_ARM in REST; fails while any of them is missing
    python - "$@" <<'PY'
import json, sys
grid, arm, rest, rest_arm = sys.argv[1:5]
width = int(sys.argv[5]) if len(sys.argv) > 5 else None
loss = lambda r: r["eval"]["loss"]["summary"]["loss"]
seed0 = [r for r in json.load(open(grid))["rows"] if r["arm"] == arm and width in (None, r["config"]["model"]["d_model"])]
others = [r for r in json.load(open(rest))["rows"] if r["arm"] == rest_arm and r["seed"] in (1, 2)]
if not seed0 or len(others) != 2:
    sys.exit(1)
print(sum(map(loss, [min(seed0, key=loss)] + others)) / 3)
PY
}

scale_points() {  # scale_points ARM SEED|mean: N=loss per width, N the non-embedding parameters
    python - "$@" <<'PY'
import json, statistics, sys
arm, seed = sys.argv[1], sys.argv[2]
rows = [r for f in ("results/scale.json", "results/settings.json") for r in json.load(open(f))["rows"]
        if r["arm"] == arm or r["arm"].startswith(arm + "_d")]
by_n = {}
for r in rows:
    if seed == "mean" or r["seed"] == int(seed):
        s = r["eval"]["loss"]["summary"]
        by_n.setdefault(s["params_nonembedding"], []).append(s["loss"])
print(" ".join(f"{n}={statistics.mean(v)!r}" for n, v in sorted(by_n.items())))
PY
}

ALL="data lr settings layernorm gamma analyses budget wd scale moe lr_width lr_fine gamma_fine settings_fine confirm report confirm_report eps_regime eps_regime_report eps_claim1 scale_wide confirm_wide scale_wide_report factorial confirm_factorial depth machine_factorial"
# The confirmation runs of results/confirm.md: seeds never run in the exploration, every setting
# fixed there (the lrs are typed, not re-chosen by best_lr), in the order the claims are listed.
CONFIRM_SEEDS=100,101,102,103,104,105
CONFIRM="lm tokens settings gamma moe budget"
SECTIONS=${*:-$ALL}

for section in $SECTIONS; do case $section in
data)
    # Build the study's data afresh (a folder made earlier may predate a corpus change), check the
    # corpus files and shards against results/data.json, then keep it as data/bi_bytes; an existing
    # data/bi_bytes is checked, never replaced. Any difference stops the script (exit 1).
    rebuild=data/.rebuild_bi_bytes
    rm -rf $rebuild
    set -f  # the globs are prepare_data.py's to expand
    python prepare_data.py text --out $rebuild $BI_BYTES || exit 1
    set +f
    python results/data_check.py $rebuild bi_bytes || exit 1
    if [ -e data/bi_bytes ]; then
        rm -rf $rebuild
        python results/data_check.py data/bi_bytes bi_bytes || exit 1
    else
        mv $rebuild data/bi_bytes
    fi
    ;;
lr)
    # 1. lr tuning, both arms, one seed: the recipe (γ=1, ε=1e-12, gate) and the standard baseline.
    $SWEEP --name lr_tune --arm recipe= --arm baseline=config/_baseline.py --grid lr=$LRS --seeds 0
    tuned_lrs; echo "best lr: recipe $R, baseline $B"
    ;;
settings)
    # 2. The two settings at γ=1 (recipe lr), and the baseline at its own lr; 3 seeds; loss + sink.
    # keep_steps: early checkpoints for the condensation trajectory (eval.py weights), free to keep.
    tuned_lrs || continue
    $SWEEP --name settings --eval loss,sink --seeds 0,1,2 --set "keep_steps=[0,5,10,20,40,80,160]" \
        --arm recipe=,lr=$R \
        --arm eps1e-5=,lr=$R,model.norm_eps=1e-5 \
        --arm no_gate=,lr=$R,model.attn_gate=none \
        --arm eps1e-5_no_gate=,lr=$R,model.norm_eps=1e-5,model.attn_gate=none \
        --arm baseline=config/_baseline.py,lr=$B
    ;;
layernorm)
    # 2c. The ε arms with LayerNorm instead of RMSNorm (γ=1, gate, recipe lr), 3 seeds.
    tuned_lrs || continue
    $SWEEP --name layernorm --eval loss,sink --seeds 0,1,2 \
        --arm ln_eps1e-12=,lr=$R,model.norm=layernorm \
        --arm ln_eps1e-5=,lr=$R,model.norm=layernorm,model.norm_eps=1e-5
    ;;
gamma)
    # 3. γ sweep with ε=1e-12 and the gate: each γ's lr tuned on seed 0, then 3 seeds at its best.
    tuned_lrs || continue
    $SWEEP --name gamma_lr --grid gamma=0.3,0.5,0.75,1.25,1.5 --grid lr=$GAMMA_LRS --seeds 0
    arms=()
    for g in 0.3 0.5 0.75 1.25 1.5; do arms+=(--arm "gamma$g=,gamma=$g,lr=$(best_lr results/gamma_lr.json base gamma=$g)"); done
    arms+=(--arm "gamma1.0=,gamma=1.0,lr=$R")  # the settings sweep's recipe arm again, so this file holds every γ
    $SWEEP --name gamma --seeds 0,1,2 "${arms[@]}"
    ;;
analyses)
    # 4. Condensation: weight structure over the settings runs' kept checkpoints (steps 0..320).
    mkdir -p results/condensation results/tokens
    for arm in recipe baseline; do
        for s in 0 1 2; do
            made results/condensation/$arm-seed$s.json || python eval.py weights out/sweeps/settings/$arm-seed$s --json-out results/condensation/$arm-seed$s.json
        done
        made results/condensation/trajectory_$arm-seed0.png || python eval.py weights out/sweeps/settings/$arm-seed0 --plot results/condensation/trajectory_$arm-seed0.png
        for step in 00000010 00000320; do
            made results/condensation/heatmap_$arm-seed0_step${step#0000}.png ||
                python eval.py weights out/sweeps/settings/$arm-seed0/ckpt_$step --heatmap results/condensation/heatmap_$arm-seed0_step${step#0000}.png
        done
    done
    # 5. Token level: Δsym of the recipe over the baseline by difficulty bucket, per seed.
    for s in 0 1 2; do
        made results/tokens/recipe_vs_baseline_seed$s.json || python eval.py tokens out/sweeps/settings/recipe-seed$s out/sweeps/settings/baseline-seed$s --tokens 262144 \
            --json-out results/tokens/recipe_vs_baseline_seed$s.json $( [ $s = 0 ] && echo --plot results/tokens/recipe_vs_baseline_seed0.png )
    done
    ;;
budget)
    # 6. Token budget (2b): recipe vs baseline from 2 to 40 tokens per non-embedding parameter (20 is
    # the settings sweep's 320 steps); warmup stays a tenth of the budget. Each arm keeps its lr tuned at
    # 320 steps: neither arm is retuned per budget.
    tuned_lrs || continue
    $SWEEP --name budget --seeds 0,1,2 --arm recipe=,lr=$R --arm baseline=config/_baseline.py,lr=$B \
        --grid max_steps:warmup_steps=32:3,96:10,640:64
    # 6b. The same comparison at 2, 6 and 40 tokens per parameter with each arm's lr retuned for that
    # budget (the 5-point grid, seed 0), then 3 seeds at each best: a short run favours a large lr,
    # and the baseline's (3e-2, tuned at 320 steps) is 10x the recipe's. (640 steps ran a session later.)
    BUDGETS="32:3 96:10 640:64"
    $SWEEP --name budget_lr --arm recipe= --arm baseline=config/_baseline.py --grid lr=$LRS --seeds 0 \
        --grid max_steps:warmup_steps=$(echo $BUDGETS | tr ' ' ,)
    arms=()
    for budget in $BUDGETS; do
        IFS=: read -r steps warm <<<"$budget"
        arms+=($(tuned_arms results/budget_lr.json s$steps max_steps=$steps max_steps=$steps,warmup_steps=$warm))
    done
    $SWEEP --name budget_tuned --seeds 0,1,2 "${arms[@]}"
    ;;
wd)
    # 7. Weight-decay pairing (2b): γ=1 with matrix decay 1.0 (its lr tuned on the same grid) against
    # γ=0.5 with 0.1, the γ sweep's gamma0.5 arm (ε=1e-12 and the gate in both).
    $SWEEP --name wd_lr --arm recipe_wd1=,weight_decay.matrix=1.0 --grid lr=$LRS --seeds 0
    $SWEEP --name wd --seeds 0,1,2 --arm "recipe_wd1=,weight_decay.matrix=1.0,lr=$(best_lr results/wd_lr.json recipe_wd1)"
    ;;
scale)
    # 8. Scale (3): widths 24, 32, 48 next to 64 (the settings sweep), 2 layers, ~20 tokens per
    # non-embedding parameter each (21k, 43k, 72k, 131k parameters); both arms' lr tuned per width on
    # 3e-3..3e-2 (seed 0), then 3 seeds at each best.
    SIZES=model.d_model:max_steps:warmup_steps=24:52:5,32:104:10,48:176:18
    $SWEEP --name scale_lr --arm recipe= --arm baseline=config/_baseline.py --grid $SIZES --grid lr=0.003,0.01,0.03 --seeds 0
    arms=()
    for size in 24:52:5 32:104:10 48:176:18; do
        IFS=: read -r d steps warm <<<"$size"
        arms+=($(tuned_arms results/scale_lr.json d$d model.d_model=$d model.d_model=$d,max_steps=$steps,warmup_steps=$warm))
    done
    $SWEEP --name scale --seeds 0,1,2 "${arms[@]}"
    # The fit: L(N) = a·N^-α + c through the baseline's 4 widths (d64 from the settings sweep), the
    # recipe's widths as effective baseline sizes. Once on the seed means (delta-method error from
    # the fit), once per seed (seed s of every width), so the multiple's spread over seeds shows.
    mkdir -p results/scaling
    for s in mean 0 1 2; do
        out=results/scaling/$([ $s = mean ] && echo mean || echo seed$s)
        made $out.json || python eval.py scaling --baseline $(scale_points baseline $s) \
            --compare $(scale_points recipe $s) --json-out $out.json $( [ $s = mean ] && echo --plot $out.png )
    done
    ;;
scale_wide)
    # 8b. Scale at widths 96 and 128 (issue 38): the scale section's rules (2 layers, ~20 tokens per
    # non-embedding parameter: 264,768 and 492,288 of them; warmup a tenth of the steps). Each arm's
    # lr on seed 0 over three points of HALF_LRS around its width-64 best on the finer grid (recipe
    # 5.5e-3, baseline 1.7e-2), widened while the best sits on an edge (wide_lrs), then seeds 1
    # and 2 at each best. Width 128 runs only once results/confirm_wide.md, its pre-registration,
    # is in a commit.
    sizes=()
    for size in $WIDE_SIZES; do
        IFS=: read -r d steps warm <<<"$size"
        if [ $d = 128 ] && [ -z "$(git rev-list -1 --all -- results/confirm_wide.md)" ]; then
            echo "width 128 waits for its pre-registration: commit results/confirm_wide.md first" >&2
            break
        fi
        sizes+=($size)
        for arm in recipe baseline; do
            file=$([ $arm = baseline ] && echo config/_baseline.py)
            start=$([ $arm = recipe ] && echo 0.003,0.0055,0.01 || echo 0.01,0.017,0.03)
            axis= next=
            while :; do
                next=$(for sz in "${sizes[@]}"; do
                    IFS=: read -r d steps warm <<<"$sz"
                    for lr in $(wide_lrs results/scale_wide_lr_$arm.json $arm $d $start | tr , ' '); do echo $d:$steps:$warm:$lr; done
                done | paste -sd,)
                [ "$axis" = "$next" ] && break
                axis=$next
                $SWEEP --name scale_wide_lr_$arm --arm "$arm=$file" --seeds 0 \
                    --grid model.d_model:max_steps:warmup_steps:lr=$axis || break
            done
        done
        arms=()
        for sz in "${sizes[@]}"; do
            IFS=: read -r d steps warm <<<"$sz"
            for arm in recipe baseline; do
                file=$([ $arm = baseline ] && echo config/_baseline.py)
                arms+=(--arm "${arm}_d$d=$file,model.d_model=$d,max_steps=$steps,warmup_steps=$warm,lr=$(best_lr results/scale_wide_lr_$arm.json $arm model.d_model=$d)")
            done
        done
        $SWEEP --name scale_wide --seeds 1,2 "${arms[@]}"
    done
    ;;
confirm_wide)
    # results/confirm_wide.md (issue 38): width 128's pair on seeds 100-105, each arm at its seed-0 best of
    # scale_wide_lr_<arm>.json (the rule fixed there; the lrs are not chosen again after these runs).
    [ -n "$(git rev-list -1 --all -- results/confirm_wide.md)" ] || { echo "commit results/confirm_wide.md first" >&2; exit 1; }
    arms=()
    for arm in recipe baseline; do
        file=$([ $arm = baseline ] && echo config/_baseline.py)
        lr=$(best_lr results/scale_wide_lr_$arm.json $arm model.d_model=128) || { echo "width 128's lr grid has not run" >&2; exit 1; }
        arms+=(--arm "${arm}_d128=$file,model.d_model=128,max_steps=1200,warmup_steps=120,lr=$lr")
    done
    $SWEEP --name confirm_wide --seeds $CONFIRM_SEEDS "${arms[@]}"
    ;;
scale_wide_report)
    # The gain per width with its interval, the seed-paired slope, the effective-size fit over every
    # width, width 128's confirmation: results/report_scale_wide.md and results/scale_wide.png.
    python results/scale_wide.py
    ;;
factorial)
    # 8d. Which change carries width 128's gain (issue 45). The recipe (A: γ=1, ε=1e-12, gate) and the
    # baseline (B: γ=0.5, ε=1e-5, no gate) of scale_wide, taken apart by four arms, each one setting away
    # from A at confirm_wide's settings: C γ=0.5 and D γ=0.75 (the fixes without small init; D is width
    # 64's optimum), F no gate, G ε = 41.94/128² (the paper's standard ε emulated: r = ε·d² ≈ 42 as at
    # d=2048). Each arm's lr on seed 0 starts at A's three half steps (3e-3, 5.5e-3, 1e-2, A's best in the
    # middle: A is every arm's nearest finished one), widened while its best sits on an edge; then seeds 1
    # and 2 at each best. C and F first: they decide the two contrasts that matter most.
    arms=()
    for arm in C_gamma05=,gamma=0.5 F_nogate=,model.attn_gate=none D_gamma075=,gamma=0.75 \
               G_stdeps=,model.norm_eps=$(awk 'BEGIN { printf "%g", 41.94 / (128 * 128) }'); do
        arm+=,model.d_model=128,max_steps=1200,warmup_steps=120
        tune_lr factorial_lr_${arm%%=*} $arm 128 0.003,0.0055,0.01 || continue
        arms+=(--arm "$arm,lr=$(best_lr results/factorial_lr_${arm%%=*}.json ${arm%%=*})")
    done
    $SWEEP --name factorial --seeds 1,2 "${arms[@]}"
    ;;
confirm_factorial)
    # results/confirm_factorial.md (issue 45): C and F on seeds 100-105 at their seed-0 best lrs, one seed more per
    # sweep call (C 100, F 100, C 101, ...) so a stop leaves whole pairs; then D, if its seeds 0-2 put it within
    # 0.01 of the recipe or ahead (mean D - A <= +0.01). A and B's seeds 100-105 are confirm_wide's.
    [ -n "$(git rev-list -1 --all -- results/confirm_factorial.md)" ] || { echo "commit results/confirm_factorial.md first" >&2; exit 1; }
    arm_128() { echo "--arm $1,model.d_model=128,max_steps=1200,warmup_steps=120,lr=$(best_lr results/factorial_lr_${1%%=*}.json ${1%%=*})"; }
    arms=($(arm_128 C_gamma05=,gamma=0.5) $(arm_128 F_nogate=,model.attn_gate=none))
    seeds=
    for s in ${CONFIRM_SEEDS//,/ }; do
        seeds+=${seeds:+,}$s
        $SWEEP --name confirm_factorial --seeds $seeds "${arms[@]}"
    done
    a=$(explored_mean results/scale_wide_lr_recipe.json recipe results/scale_wide.json recipe_d128 128) &&
        d=$(explored_mean results/factorial_lr_D_gamma075.json D_gamma075 results/factorial.json D_gamma075) ||
        { echo "D's seeds 0-2 have not all run (cpu_lm.sh factorial): D's place in the confirmation waits" >&2; exit 1; }
    if awk -v a=$a -v d=$d 'BEGIN { printf "D - A over seeds 0-2: %+.4f: ", d - a; exit !(d - a <= 0.01) }'; then
        echo "D joins"
        $SWEEP --name confirm_factorial --seeds $CONFIRM_SEEDS "${arms[@]}" $(arm_128 D_gamma075=,gamma=0.75)
    else
        echo "D does not join"
    fi
    ;;
machine_factorial)
    # How far the CPU alone moves a width-128 result (issue 45): F's seed 103 of confirm_factorial ran on an AMD EPYC
    # (the machine a session was given), its pair and every earlier confirmation row on an Intel Xeon. Two Intel
    # points rerun unchanged on the other CPU: the recipe's seed 103 (confirm_wide) and F's seed 100
    # (confirm_factorial), each into its own file, compared by `python results/factorial.py`. Not a verdict.
    wide=model.d_model=128,max_steps=1200,warmup_steps=120
    lr=$(best_lr results/scale_wide_lr_recipe.json recipe model.d_model=128)
    $SWEEP --name machine_recipe --seeds 103 --arm "recipe_d128=,$wide,lr=$lr"
    lr=$(best_lr results/factorial_lr_F_nogate.json F_nogate)
    $SWEEP --name machine_F --seeds 100 --arm "F_nogate=,model.attn_gate=none,$wide,lr=$lr"
    ;;
depth)
    # 8e. Depth at equal size (issue 45, item 4): the recipe and the baseline with 4 layers at width 96,
    # 504,768 non-embedding parameters (width 128 at 2 layers: 492,288), 1,232 steps of 8,192 tokens
    # (20.0 tokens per parameter), warmup a tenth. Each arm's lr on seed 0 starts at its width-96 best's
    # half steps (both 1e-2: 5.5e-3, 1e-2, 1.7e-2), widened while the best sits on an edge; seeds 1, 2.
    arms=()
    for arm in recipe_L4= baseline_L4=config/_baseline.py; do
        arm+=,model.n_layer=4,model.d_model=96,max_steps=1232,warmup_steps=123
        tune_lr depth_lr_${arm%%=*} $arm 96 0.0055,0.01,0.017 || continue
        arms+=(--arm "$arm,lr=$(best_lr results/depth_lr_${arm%%=*}.json ${arm%%=*})")
    done
    $SWEEP --name depth --seeds 1,2 "${arms[@]}"
    ;;
moe)
    # 9. MoE (7): 4 experts of width 96, top-2 (the dense model's active MLP width), both arms' lr on
    # 3e-3..3e-2 (seed 0), then 3 seeds at each best.
    MOE="--set model.n_experts=4 --set model.top_k=2 --set model.d_expert=96"
    $SWEEP --name moe_lr $MOE --arm recipe= --arm baseline=config/_baseline.py --grid lr=0.003,0.01,0.03 --seeds 0
    $SWEEP --name moe $MOE --seeds 0,1,2 --arm "recipe=,lr=$(best_lr results/moe_lr.json recipe)" \
        --arm "baseline=config/_baseline.py,lr=$(best_lr results/moe_lr.json baseline)"
    ;;
lr_width)
    # 10. lr transfer across width (8): the residual-flow argument says γ=1 makes updates
    # width-independent, so its best lr should move less with width than γ=0.5's. Widths 32, 64,
    # 128, 256 (2 layers; 256 and lr 3e-4 ran a session later), one budget for all (96 steps), the
    # lr grid WIDTH_LRS, seed 0, one sweep per arm.
    # 10b. Seeds 1 and 2 where the best lr is decided: at every width (32 ran a session after the
    # others), the seed-0 best and its grid neighbours (a zipped width:lr axis), then the
    # neighbours of any seed's best outside those, until near_best stops growing.
    for arm in recipe baseline; do
        file=$([ $arm = baseline ] && echo config/_baseline.py)
        $SWEEP --name lr_width_$arm --grid lr=$WIDTH_LRS --set max_steps=96 --set warmup_steps=10 \
            $(for d in 32 64 128 256; do echo --arm "${arm}_d$d=$file,model.d_model=$d"; done)
        lrs= next=$(near_best $arm)
        while [ "$lrs" != "$next" ]; do
            lrs=$next
            $SWEEP --name lr_width_seeds_$arm --arm "$arm=$file" --seeds 1,2 --set max_steps=96 --set warmup_steps=10 \
                --grid model.d_model:lr=$lrs
            next=$(near_best $arm)
        done
    done
    ;;
lr_fine)
    # 11. The lr section's grid at half steps (each a geometric midpoint, ~1.8x from its neighbours),
    # both arms, seed 0: a 3x grid can step over an optimum (the baseline's 1e-2, 2.086, is within
    # 0.007 of its best 3e-2; the recipe's 3e-3, 2.076, sits between two worse points). Then 6 seeds
    # at each arm's best over both grids: does the main comparison hold at the finer optimum? Seeds
    # 3-5 were added (a fixed 3 more, once) after seeds 0-2 put the recipe ahead on every seed with
    # an interval that included 0.
    $SWEEP --name lr_fine --arm recipe= --arm baseline=config/_baseline.py --grid lr=$FINE_LRS --seeds 0
    $SWEEP --name lr_fine_seeds --seeds 0,1,2,3,4,5 --arm "recipe=,lr=$(fine_lr recipe)" \
        --arm "baseline=config/_baseline.py,lr=$(fine_lr baseline)"
    ;;
gamma_fine)
    # 11b. The same half steps for γ=0.5 and 0.75, which beat γ=1 in the γ sweep, so γ=1 at its
    # finer best meets them on the same grid (seed 0), then 3 seeds at each one's best over both grids.
    $SWEEP --name gamma_fine --grid gamma=0.5,0.75 --grid lr=$FINE_LRS --seeds 0
    $SWEEP --name gamma_fine_seeds --seeds 0,1,2 $(for g in 0.5 0.75; do
        echo --arm "gamma$g=,gamma=$g,lr=$(best_lr results/gamma_lr.json,results/gamma_fine.json base gamma=$g)"; done)
    ;;
settings_fine)
    # 11c. The two settings' arms at the recipe's finer best, 3 seeds; the recipe's own runs are
    # lr_fine_seeds'.
    R=$(fine_lr recipe)
    $SWEEP --name settings_fine --eval loss,sink --seeds 0,1,2 \
        --arm eps1e-5=,lr=$R,model.norm_eps=1e-5 \
        --arm no_gate=,lr=$R,model.attn_gate=none \
        --arm eps1e-5_no_gate=,lr=$R,model.norm_eps=1e-5,model.attn_gate=none
    ;;
confirm)
    # results/confirm.md, claims 1-6 (CONFIRM_CLAIMS="lm tokens" picks some). Each sweep is results/confirm_<claim>.json.
    for claim in ${CONFIRM_CLAIMS:-$CONFIRM}; do case $claim in
    lm)  # 1. the main loss claim at each arm's best on the finer grid
        $SWEEP --name confirm_lm --seeds $CONFIRM_SEEDS --arm recipe=,lr=0.0055 --arm baseline=config/_baseline.py,lr=0.017 ;;
    tokens)  # 2. Δsym by difficulty bucket on claim 1's runs
        mkdir -p results/confirm_tokens
        for s in ${CONFIRM_SEEDS//,/ }; do
            made results/confirm_tokens/seed$s.json || python eval.py tokens out/sweeps/confirm_lm/recipe-seed$s \
                out/sweeps/confirm_lm/baseline-seed$s --tokens 262144 --json-out results/confirm_tokens/seed$s.json
        done ;;
    settings)  # 3. both settings off at the recipe's lr (the recipe's runs are claim 1's)
        $SWEEP --name confirm_settings --eval loss,sink --seeds $CONFIRM_SEEDS \
            --arm eps1e-5_no_gate=,lr=0.0055,model.norm_eps=1e-5,model.attn_gate=none ;;
    gamma)  # 4. γ=0.5 and 0.75 at their finer bests (γ=1 is claim 1's recipe)
        $SWEEP --name confirm_gamma --seeds $CONFIRM_SEEDS --arm gamma0.5=,gamma=0.5,lr=0.03 --arm gamma0.75=,gamma=0.75,lr=0.017 ;;
    moe)  # 5. MoE, 4 experts top-2, both arms at their tuned lr
        $SWEEP --name confirm_moe --seeds $CONFIRM_SEEDS --set model.n_experts=4 --set model.top_k=2 --set model.d_expert=96 \
            --arm recipe=,lr=0.01 --arm baseline=config/_baseline.py,lr=0.01 ;;
    budget)  # 6. 40 tokens per parameter, both arms at their lr retuned for it
        $SWEEP --name confirm_budget --seeds $CONFIRM_SEEDS --set max_steps=640 --set warmup_steps=64 \
            --arm recipe=,lr=0.01 --arm baseline=config/_baseline.py,lr=0.01 ;;
    *) echo "unknown confirmation claim $claim: one of $CONFIRM" >&2; exit 2 ;;
    esac; done
    ;;
confirm_report)
    # results/confirm.md's tables, from the confirmation seeds alone: each claim's d per seed, its
    # mean, std and 95% t-interval (eval.py report --pair: B - A). A claim whose runs have not all
    # landed is skipped.
    c=results/confirm
    made ${c}_lm.json && python eval.py report ${c}_lm.json --per-seed loss --out results/report_confirm_lm.md \
        --pair ${c}_lm.json:recipe ${c}_lm.json:baseline
    made ${c}_tokens/seed105.json && python eval.py report ${c}_tokens/*.json --out results/report_confirm_tokens.md
    made ${c}_settings.json && python eval.py report ${c}_settings.json --per-seed loss \
        --pair ${c}_lm.json:recipe ${c}_settings.json:eps1e-5_no_gate --out results/report_confirm_settings.md
    made ${c}_gamma.json && python eval.py report ${c}_gamma.json --per-seed loss --out results/report_confirm_gamma.md \
        --pair ${c}_gamma.json:gamma0.5 ${c}_lm.json:recipe --pair ${c}_gamma.json:gamma0.75 ${c}_lm.json:recipe
    for claim in moe budget; do
        made ${c}_$claim.json && python eval.py report ${c}_$claim.json --per-seed loss \
            --pair ${c}_$claim.json:recipe ${c}_$claim.json:baseline --out results/report_confirm_$claim.md
    done
    ;;
eps_regime)
    # Issue 26, item 1: the ε regime law. At init the residual stream's mean square is about d^-2γ,
    # so RMSNorm's ε acts through one ratio, r = ε·d^(2γ): at the paper's d=2048, γ=1, ε=1e-5,
    # r ≈ 42 (ε dominates the norm); at this study's d=64 the same ε is r ≈ 0.04. The regime is
    # reached here by raising ε instead of d. γ=1 with the gate at the scale section's widths and
    # budgets (~20 tokens per parameter) and each width's recipe lr, ε = r/d^2 for r = 1e-3..1e2
    # next to ε=1e-12, 3 seeds; then γ=0.5 (ε=1e-12's γ sweep arm and lr) at d 64 with d 64's ε
    # values, where r = ε·d is 64x smaller. The question: does Δloss(ε) collapse onto one curve in r?
    tuned_lrs || continue
    RATIOS="0.001 0.01 0.1 1 10 100"
    arms=()
    for size in 32:104:10 48:176:18 64:320:32; do
        IFS=: read -r d steps warm <<<"$size"
        lr=$([ $d = 64 ] && echo $R || best_lr results/scale_lr.json recipe model.d_model=$d)
        for eps in 1e-12 $(for r in $RATIOS; do awk "BEGIN { printf \"%g \", $r / ($d * $d) }"; done); do
            arms+=(--arm "g1_d${d}_eps$eps=,model.d_model=$d,max_steps=$steps,warmup_steps=$warm,lr=$lr,model.norm_eps=$eps")
            [ $d = 64 ] && arms+=(--arm "g05_d64_eps$eps=,gamma=0.5,lr=$(best_lr results/gamma_lr.json base gamma=0.5),model.norm_eps=$eps")
        done
    done
    $SWEEP --name eps_regime --seeds 0,1,2 "${arms[@]}"
    ;;
eps_regime_report)
    # The ε regime law's analysis (results/report_eps_regime.md, eps_regime.png): Δloss against r by
    # width and the γ=0.5 control, the widths' spread against seed noise, r ≈ 42's share of the
    # recipe's gain. It also measures r at every norm of each finished run's final checkpoint, once per
    # run, into results/eps_regime_r.json, so the report regenerates after the run folders are gone.
    python results/eps_regime.py
    ;;
eps_claim1)
    # Issue 26, item 2: the paper's claim 1 at emulated scale. Its standard settings at d=2048 are
    # γ=1 with ε=1e-5 (r = ε·d² ≈ 42) and no gate; at width d the same r is ε = 41.94/d². That arm
    # ("standard") next to the recipe and the baseline of the scale section (d 32, 48) and of the
    # settings sweep (d 64), its lr tuned like theirs: the scale grid on seed 0 (with 1e-3: the
    # recipe's best at d 64 is 3e-3, that grid's edge), then 3 seeds at its best.
    arms=()
    for size in 32:104:10 48:176:18 64:320:32; do
        IFS=: read -r d steps warm <<<"$size"
        arms+=(--arm "standard_d$d=,model.d_model=$d,max_steps=$steps,warmup_steps=$warm,model.attn_gate=none,model.norm_eps=$(awk "BEGIN { printf \"%g\", 41.94 / ($d * $d) }")")
    done
    $SWEEP --name eps_claim1_lr --grid lr=0.001,0.003,0.01,0.03 --seeds 0 "${arms[@]}"
    for i in 1 3 5; do  # each arm at its best lr
        lr=$(best_lr results/eps_claim1_lr.json ${arms[$i]%%=*}) || continue 2
        arms[$i]+=",lr=$lr"
    done
    $SWEEP --name eps_claim1 --seeds 0,1,2 "${arms[@]}"
    pairs=()
    for d in 32 48; do
        pairs+=(--pair results/eps_claim1.json:standard_d$d results/scale.json:baseline_d$d
                --pair results/scale.json:recipe_d$d results/scale.json:baseline_d$d)
    done
    pairs+=(--pair results/eps_claim1.json:standard_d64 results/settings.json:baseline
            --pair results/settings.json:recipe results/settings.json:baseline)
    python eval.py report results/eps_claim1_lr.json results/eps_claim1.json "${pairs[@]}" --per-seed loss \
        --out results/report_eps_claim1.md
    ;;
report)
    # The README tables and plots.
    python eval.py report results/lr_tune.json --plot-x lr --out results/report_lr.md
    python eval.py report results/settings.json results/layernorm.json --plot-x arm --out results/report_settings.md
    python eval.py report results/gamma_lr.json --out results/report_gamma_lr.md
    python eval.py report results/gamma.json --plot-x gamma --out results/report_gamma.md
    python eval.py report results/condensation/*.json results/tokens/*.json --out results/report_analyses.md
    python eval.py report results/budget.json --plot-x max_steps --out results/report_budget.md \
        $(for n in 32 96 640; do echo --pair results/budget.json:recipe:max_steps=$n results/budget.json:baseline:max_steps=$n; done)
    python eval.py report results/budget_lr.json --out results/report_budget_lr.md
    python eval.py report results/budget_tuned.json --plot-x max_steps --out results/report_budget_tuned.md \
        $(for n in 32 96 640; do echo --pair results/budget_tuned.json:recipe_s$n results/budget_tuned.json:baseline_s$n; done)
    python eval.py report results/wd_lr.json results/wd.json --out results/report_wd.md \
        --pair results/gamma.json:gamma0.5 results/wd.json:recipe_wd1 --pair results/settings.json:recipe results/wd.json:recipe_wd1
    python eval.py report results/gamma.json results/wd.json --plot-x arm --plot-together results/wd.png --out results/report_wd_arms.md
    python eval.py report results/scale_lr.json --out results/report_scale_lr.md
    python eval.py report results/scale.json --plot-x model.d_model --out results/report_scale.md \
        $(for d in 24 32 48; do echo --pair results/scale.json:recipe_d$d results/scale.json:baseline_d$d; done) \
        --pair results/settings.json:recipe results/settings.json:baseline
    python eval.py report results/scaling/*.json --out results/report_scaling.md
    python eval.py report results/lr_width_recipe.json results/lr_width_baseline.json --plot-x lr --out results/report_lr_width.md
    python eval.py report results/lr_width_seeds_recipe.json results/lr_width_seeds_baseline.json --per-seed loss \
        --out results/report_lr_width_seeds.md
    python eval.py report results/moe_lr.json results/moe.json --plot-x arm --out results/report_moe.md
    python eval.py report results/lr_tune.json results/lr_fine.json --plot-x lr --plot-together results/lr_fine.png \
        --out results/report_lr_fine.md
    python eval.py report results/lr_fine_seeds.json --per-seed loss --out results/report_lr_fine_seeds.md \
        --pair results/lr_fine_seeds.json:recipe results/lr_fine_seeds.json:baseline
    python eval.py report results/gamma_lr.json results/gamma_fine.json --out results/report_gamma_fine.md
    python eval.py report results/gamma_fine_seeds.json results/lr_fine_seeds.json --per-seed loss --plot-x arm \
        --plot-together results/gamma_fine_seeds.png --out results/report_gamma_fine_seeds.md \
        $(for g in 0.5 0.75; do echo --pair results/lr_fine_seeds.json:recipe results/gamma_fine_seeds.json:gamma$g; done)
    python eval.py report results/lr_fine_seeds.json results/settings_fine.json --per-seed loss --plot-x arm \
        --plot-together results/settings_fine.png --out results/report_settings_fine.md \
        $(for a in eps1e-5 no_gate eps1e-5_no_gate; do echo --pair results/lr_fine_seeds.json:recipe results/settings_fine.json:$a; done)
    ;;
*) echo "unknown section $section: one of $ALL" >&2; exit 2 ;;
esac; done
