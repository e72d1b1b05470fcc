#!/usr/bin/env bash
# The CPU language-model experiments of README "Results", in the order they ran. Resumable:
# every sweep skips its finished points, so rerunning this script after a kill continues.
# Each arm's lr is the best of an lr grid on seed 0 (by eval.py loss on the val split), chosen by
# best_lr below from the committed tuning results (every grid row is in results/*.json). The
# recipe-vs-baseline grid spans 1e-3..1e-1: on 1e-3..3e-2 the baseline's best was the 3e-2 edge.
# The γ sweep's per-γ grid is 1e-3..3e-2 (time); a best at its edge is reported as such.
#   python prepare_data.py text --out data/bi_bytes --tokenizer bytes --max-tokens 16M \
#       --source en=../shared/data/corpus/en,weight=0.5 --source zh=../shared/data/corpus/zh/four_classics,weight=0.5
#   bash results/cpu_lm.sh            # one point at a time, one thread: ~2 min per point
set -uo pipefail  # no -e: a failed point (or sweep) must not stop the later sweeps
cd "$(dirname "$0")/.."
JOBS=${JOBS:-1}
BASE=config/cpu_lm.py
LRS=0.001,0.003,0.01,0.03,0.1
GAMMA_LRS=0.001,0.003,0.01,0.03
SWEEP="python sweep.py $BASE --jobs $JOBS"

best_lr() {  # best_lr RESULTS ARM [GAMMA]: the lr of the lowest eval loss among the arm's rows
    python - "$@" <<'PY'
import json, sys
path, arm, gamma = sys.argv[1], sys.argv[2], (float(sys.argv[3]) if len(sys.argv) > 3 else None)
rows = [r for r in json.load(open(path))["rows"] if r["arm"] == arm
        and (gamma is None or r["setting"].get("gamma", r["config"]["gamma"]) == gamma)]
print(min(rows, key=lambda r: r["eval"]["loss"]["summary"]["loss"])["setting"]["lr"])
PY
}

# 1. lr tuning, both arms, one seed: the recipe (γ=1, ε=1e-12, gate) and the standard baseline.
$SWEEP --name lr_tune --arm recipe= --arm baseline=config/_baseline.py --grid lr=$LRS --seeds 0
R=$(best_lr results/lr_tune.json recipe); B=$(best_lr results/lr_tune.json baseline)
echo "best lr: recipe $R, baseline $B"

# 2. The two settings at γ=1 (recipe lr), and the baseline at its own lr; 3 seeds; loss + sink.
# keep_steps: early checkpoints for the condensation trajectory (eval.py weights), free to keep.
$SWEEP --name settings --eval loss,sink --seeds 0,1,2 --set "keep_steps=[0,5,10,20,40,80,160]" \
    --arm recipe=,lr=$R \
    --arm eps1e-5=,lr=$R,model.norm_eps=1e-5 \
    --arm no_gate=,lr=$R,model.attn_gate=none \
    --arm eps1e-5_no_gate=,lr=$R,model.norm_eps=1e-5,model.attn_gate=none \
    --arm baseline=config/_baseline.py,lr=$B

# 2c. The ε arms with LayerNorm instead of RMSNorm (γ=1, gate, recipe lr), 3 seeds.
$SWEEP --name layernorm --eval loss,sink --seeds 0,1,2 \
    --arm ln_eps1e-12=,lr=$R,model.norm=layernorm \
    --arm ln_eps1e-5=,lr=$R,model.norm=layernorm,model.norm_eps=1e-5

# 3. γ sweep with ε=1e-12 and the gate: each γ's lr tuned on seed 0, then 3 seeds at its best.
$SWEEP --name gamma_lr --grid gamma=0.3,0.5,0.75,1.25,1.5 --grid lr=$GAMMA_LRS --seeds 0
arms=()
for g in 0.3 0.5 0.75 1.25 1.5; do arms+=(--arm "gamma$g=,gamma=$g,lr=$(best_lr results/gamma_lr.json base $g)"); done
arms+=(--arm "gamma1.0=,gamma=1.0,lr=$R")  # the settings sweep's recipe arm again, so this file holds every γ
$SWEEP --name gamma --seeds 0,1,2 "${arms[@]}"
