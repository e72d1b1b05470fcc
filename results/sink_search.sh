#!/usr/bin/env bash
# Issue 26, item 4: find a CPU setting where the standard baseline forms an attention sink, then
# test the paper's claim there: "small init raises the attention sink, the gate removes it". At
# the study's setting (config/cpu_lm.py: 2 layers, 256 tokens, 320 steps) every first-token share
# was about 1%, no more than uniform attention gives, so the claim was untested (results/README.md).
#   bash results/cpu_lm.sh data                 # data/bi_bytes, once (this script builds no data)
#   bash results/sink_search.sh [SECTION ...]   # default: search search_report claim claim_report
#   DRY_RUN=1 bash results/sink_search.sh search claim   # the points and commands; nothing runs
# Resumable like cpu_lm.sh: every sweep skips its finished points; rerunning continues.
#
# The metric (eval.py sink, run on every point by sweep.py --eval loss,sink). For each layer and
# head, the mean over query positions of the attention on the first token; a sink head is one
# whose mean exceeds 0.3, and sink_heads is the share of (layer, head) pairs that are sink heads:
# Gu et al. 2025, "When Attention Sink Emerges in Language Models", with their threshold. Next to
# it the mean share over all heads (the study's earlier number) and the chance level (a head that
# attends uniformly). Under config/cpu_lm.py's document masking a query sees only its own
# document, and RoPE scores depend on relative positions only, so a document's first token is,
# to the model, exactly a sequence's first token: the metric that counts is the one on each
# query's document start (report columns sink_doc_heads, sink_doc_first). The window's own first
# token (sink_heads, sink_first) is seen only by the first document's queries.
#
# The criterion, fixed before any search run: a setting shows a sink when its baseline run
# (seed 0) has sink_doc_heads >= 0.25, i.e. at least a quarter of its heads put more than 0.3 of
# their attention, on average, on the document start: 1 of 4 heads at depth 2, 2 of 8 at depth 4,
# 3 of 12 at depth 6. A quarter rather than "any head": at depth 4-6 one head with a positional
# habit should not decide it. Uniform attention puts about 0.01-0.03 there on this data.
#
# search: the baseline (config/_baseline.py: γ=0.5, ε=1e-5, no gate; its lr tuned in
# results/lr_tune.json, 3e-2, the one the settings sweep's baseline ran at) on the cheaper axes
# first: sequence length 512 and 1024 (the study: 256), depth 2, 4, 6 (the study: 2), 320 and
# 1280 steps. Every point keeps 8,192 tokens a step (global_batch = 8192 / seq_len), so steps are
# tokens (320: 2.6M, 1280: 10.5M, 2/3 of an epoch of data/bi_bytes) and warmup stays a tenth.
# One seed. The points run in the order of their estimated cost and the search stops at the first
# that shows a sink (the smallest setting), or when the next point would take the points' summed
# wall time (core-seconds: one thread a point) past SINK_BUDGET_S (default 7200, 2 core-hours).
# Estimated cost, relative to the first point (T512_L2_s320): per-step times of steps 3-8 of 8 at
# OMP_NUM_THREADS=1, the fastest of two rounds, taken while two other experiments ran on this
# 2-core machine (so ratios, not absolute times), fit as c + L·(a + b·T), plus the loss and sink
# evaluations (about 40 steps' worth). The first point comes to ~3.3 minutes at that load (the
# study's 2-layer, 256-token point: 93-147 s of wall_s on an idle core); the 10 points up to
# T512_L6_s1280 sum to ~37.5 units, ~2 core-hours; the last two run only if the machine is
# faster than that, and the budget check uses the first point's measured wall time.
SEARCH="T512_L2_s320:1.00 T1024_L2_s320:1.43 T512_L4_s320:1.78 T512_L6_s320:2.55 T1024_L4_s320:2.64
        T512_L2_s1280:3.53 T1024_L6_s320:3.85 T1024_L2_s1280:5.10 T512_L4_s1280:6.38 T512_L6_s1280:9.21
        T1024_L4_s1280:9.54 T1024_L6_s1280:14.0"
#
# claim: at the setting found (or SINK_SETTING=T512_L4_s1280, a name of the SEARCH form), γ {0.5,
# 1} × gate {none, elementwise}, 3 seeds (0-2; the search's seed 0 runs again, in its own sweep),
# ε=1e-5 in every arm so that only γ and the gate move (at d=64, r = ε·d^2γ is 0.04 at γ=1: ε
# barely acts). lrs: each γ's best of results/lr_tune.json (γ=1: the recipe's, 3e-3; γ=0.5: the
# baseline's, 3e-2), neither retuned at the new setting (tune both or neither, and a retune is
# 10 points per γ). Caveat: γ=1 then trains at a tenth of γ=0.5's lr, and a smaller lr can
# itself delay a sink (Gu et al.); claim_samelr (not in the default sections) runs the three
# arms of the two comparisons at one lr, 1e-2, between the two, 3 seeds, as the control. Cost:
# 12 points (claim_samelr: 9), each about the found point's wall time (e.g. at T512_L4_s320,
# ~1.2 core-hours; at T512_L6_s1280, ~6).
# The verdict rule, fixed before any claim run (eval.py report --pair, B - A by seed, 95%
# t-interval over 3 seeds), on sink_doc_heads, with sink_doc_first (the mean share) beside it:
#   raises:  g1_none - g05_none > 0. Interval above 0: reproduced; every seed > 0 but the interval
#            includes 0: in the paper's direction, not resolved; interval below 0: opposite;
#            else not resolved.
#   removes: g1_gate - g1_none < 0, the same rule; "removes" only if g1_gate is also below the
#            sink criterion (sink_doc_heads < 0.25) on every seed, else "lowers".
# Where the two metrics disagree, both are reported.
set -uo pipefail  # no -e: a failed point must not stop the reports
cd "$(dirname "$0")/.."
JOBS=${JOBS:-1}
BUDGET_S=${SINK_BUDGET_S:-7200}
HEADS_MIN=0.25
DRY=${DRY_RUN:+--dry-run}
SWEEP="python sweep.py config/cpu_lm.py --jobs $JOBS --eval loss,sink $DRY"
made() { [ -s "$1" ]; }

setting() {  # setting T512_L4_s1280: that point's train.py overrides (8,192 tokens a step at any length)
    local t l s
    [[ $1 =~ ^T([0-9]+)_L([0-9]+)_s([0-9]+)$ ]] || { echo "setting $1: write T<seq_len>_L<n_layer>_s<steps>, e.g. T512_L4_s1280" >&2; return 1; }
    t=${BASH_REMATCH[1]} l=${BASH_REMATCH[2]} s=${BASH_REMATCH[3]}
    (( 8192 % t == 0 )) || { echo "setting $1: seq_len must divide 8192" >&2; return 1; }
    echo "seq_len=$t,model.max_seq_len=$t,global_batch=$((8192 / t)),batch_size=$((8192 / t)),model.n_layer=$l,max_steps=$s,warmup_steps=$((s / 10))"
}

best_lr() {  # best_lr ARM: the lr of the arm's lowest eval loss in results/lr_tune.json (seed 0)
    python - "$1" <<'PY'
import json, sys
rows = [r for r in json.load(open("results/lr_tune.json"))["rows"] if r["arm"] == sys.argv[1]]
print(min(rows, key=lambda r: r["eval"]["loss"]["summary"]["loss"])["setting"]["lr"])
PY
}

search_py() {  # search_py plan|found|summary: read results/sink_search.json against SEARCH
    python - "$1" "$BUDGET_S" "$HEADS_MIN" "$JOBS" $SEARCH <<'PY'
import json, os, sys
mode, budget, heads_min, jobs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
search = [(e.split(":")[0], float(e.split(":")[1])) for e in sys.argv[5:]]
path = "results/sink_search.json"
rows = {r["arm"]: r for r in json.load(open(path))["rows"]} if os.path.exists(path) else {}

def sink(row):
    return row["eval"]["sink"]["summary"]

def shows(row):
    return sink(row).get("sink_heads_doc_first", -1) >= heads_min

found = next((name for name, _ in search if name in rows and shows(rows[name])), None)
if mode == "found":  # the smallest setting with a sink, for the claim section
    if found is None:
        sys.exit(1)
    print(found)
elif mode == "plan":
    # The arms of the next sweep call, in SEARCH order: every finished one (so the results file
    # keeps their rows) and up to JOBS new ones; nothing once a sink is found or the next point
    # would pass the budget. A point's cost: its ratio times the first point's measured wall time.
    first = rows.get(search[0][0])
    unit = first["wall_s"] / search[0][1] if first else None
    spent = sum(r["wall_s"] for r in rows.values())
    call, new = [], 0
    for name, ratio in search:
        if name in rows:
            if shows(rows[name]):
                print(f"search: {name} shows a sink; the search stops there", file=sys.stderr)
                sys.exit(0)
            call.append(name)
            continue
        if new == jobs:
            break
        if unit is not None and spent + ratio * unit > budget:
            print(f"search: {name} (~{ratio * unit / 60:.0f} min) would pass the budget: {spent / 3600:.2f} of "
                  f"{budget / 3600:.2f} core-hours spent or started; the search stops there", file=sys.stderr)
            break
        spent += ratio * unit if unit is not None else 0
        call.append(name)
        new += 1
    if new:
        print(" ".join(call))
elif mode == "summary":  # every setting tried, its sink numbers and the criterion
    threshold = sink(next(iter(rows.values()))).get("threshold", 0.3) if rows else 0.3
    lines = ["### the criterion", "",
             f"A sink: the baseline's sink_doc_heads >= {heads_min}, the share of heads whose mean attention on the "
             f"query's document start exceeds {threshold}. Chance: what uniform attention would put there.", "",
             "| setting | seq_len | layers | steps | tokens | wall s | loss | sink_doc_heads | sink_doc_first | chance (doc) "
             "| max head (doc) | sink_heads | sink_first | chance (first) | sink |", "|" + "---|" * 15]
    tried = [name for name, _ in search if name in rows]
    for name in tried:
        r, s = rows[name], sink(rows[name])
        cfg = r["config"]
        cells = [name, cfg["seq_len"], cfg["model"]["n_layer"], cfg["max_steps"], r["tokens"], f"{r['wall_s']:.0f}",
                 f"{r['eval']['loss']['summary']['loss']:.4f}", f"{s.get('sink_heads_doc_first', float('nan')):.4f}",
                 f"{s['mean_share_doc_first']:.4f}", f"{s.get('uniform_share_doc_first', float('nan')):.4f}",
                 f"{s['max_share_doc_first']:.4f}", f"{s.get('sink_heads_first', float('nan')):.4f}",
                 f"{s['mean_share_first']:.4f}", f"{s.get('uniform_share_first', float('nan')):.4f}",
                 "yes" if shows(r) else "no"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    spent = sum(r["wall_s"] for r in rows.values())
    lines += ["", f"{len(tried)} of {len(search)} settings tried, {spent / 3600:.2f} core-hours."]
    if found:
        lines.append(f"The smallest setting whose baseline shows a sink: {found}.")
    elif tried:
        lines.append(f"No setting tried shows a sink; the largest tried (by estimated cost): {tried[-1]}.")
    print("\n".join(lines))
PY
}

ALL="search search_report claim claim_report"
SECTIONS=${*:-$ALL}
if [ -z "$DRY" ] && [ ! -s data/bi_bytes/meta.json ]; then
    echo "no data/bi_bytes: run bash results/cpu_lm.sh data first" >&2
    exit 1
fi

for section in $SECTIONS; do case $section in
search)
    B=$(best_lr baseline) || continue
    arms_of() { for name in "$@"; do echo "--arm $name=config/_baseline.py,lr=$B,$(setting $name)"; done; }
    if [ -n "$DRY" ]; then  # every point of the search, as if none stopped it
        $SWEEP --name sink_search --seeds 0 $(arms_of $(for e in $SEARCH; do echo ${e%%:*}; done))
        continue
    fi
    while names=$(search_py plan) && [ -n "$names" ]; do
        $SWEEP --name sink_search --seeds 0 $(arms_of $names) || { echo "search: a point failed (its sweep.log says why); rerunning resumes" >&2; break; }
    done
    ;;
search_report)
    made results/sink_search.json || { echo "no results/sink_search.json: run the search section first" >&2; continue; }
    python eval.py report results/sink_search.json --out results/report_sink_search.md
    search_py summary | tee -a results/report_sink_search.md
    ;;
claim|claim_samelr)
    if [ -n "${SINK_SETTING:-}" ]; then
        found=$SINK_SETTING
    elif ! found=$(search_py found); then
        echo "$section: no setting of the search shows a sink (see results/report_sink_search.md), so there is no" \
             "sink to test the claim on; SINK_SETTING=<name> runs it at a setting of your choice" >&2
        continue
    fi
    over=$(setting "$found") || continue
    echo "$section at $found: $over"
    if [ $section = claim ]; then
        R=$(best_lr recipe) && B=$(best_lr baseline) || continue
        $SWEEP --name sink_claim --seeds 0,1,2 \
            --arm "g05_none=config/_baseline.py,lr=$B,$over" \
            --arm "g05_gate=config/_baseline.py,model.attn_gate=elementwise,lr=$B,$over" \
            --arm "g1_none=config/_baseline.py,gamma=1.0,lr=$R,$over" \
            --arm "g1_gate=config/_baseline.py,gamma=1.0,model.attn_gate=elementwise,lr=$R,$over"
    else  # the lr control: the two comparisons' arms at one lr
        $SWEEP --name sink_claim_samelr --seeds 0,1,2 \
            --arm "g05_none=config/_baseline.py,lr=0.01,$over" \
            --arm "g1_none=config/_baseline.py,gamma=1.0,lr=0.01,$over" \
            --arm "g1_gate=config/_baseline.py,gamma=1.0,model.attn_gate=elementwise,lr=0.01,$over"
    fi
    ;;
claim_report)
    # Per arm: every metric mean ± std, the sink numbers seed by seed; the pairs of the verdict rule
    # (B - A by seed): raises = g1_none - g05_none, removes = g1_gate - g1_none, and the gate at γ=0.5.
    for name in sink_claim sink_claim_samelr; do
        c=results/$name.json
        made $c || { [ $name = sink_claim ] && echo "no $c: run the claim section first" >&2; continue; }
        pairs=(--pair $c:g05_none $c:g1_none --pair $c:g1_none $c:g1_gate)
        [ $name = sink_claim ] && pairs+=(--pair $c:g05_none $c:g05_gate)
        for metric in sink_doc_heads sink_doc_first; do
            python eval.py report $c --per-seed sink_doc_heads,sink_doc_first,loss --pair-metric $metric "${pairs[@]}" \
                --out results/report_${name}_$metric.md
        done
    done
    ;;
*) echo "unknown section $section: one of $ALL claim_samelr" >&2; exit 2 ;;
esac; done
