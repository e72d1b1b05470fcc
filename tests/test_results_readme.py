"""The study's numbers come from the committed results. Every decimal number in the claims tables
of results/README.md (header "| the paper says ..." or "| the predecessor says ...") and in its
verdict table (header "| claim | verdict ...") must appear as text in a result file
(results/report_*.md or results/*.json; a leading sign and a trailing % or × are not part of the
number), or be listed below: ROUNDED names the file and the value a rounded number was taken
from (checked: the value is in that file and rounds to the number), KNOWN says where a number
that no result file holds comes from. A number of two or three decimals can match an unrelated
value (an lr of 0.017, an anchor share of 0.045): where one was found to, its real source is
listed too, and checked. The links between the two documents must resolve."""
import glob
import os
import re
from decimal import Decimal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results")

CLAIMS_HEADERS = ("| the paper says", "| the predecessor says", "| # | claim (paper's side)")
VERDICT_HEADERS = ("| claim | verdict",)

# A decimal number, not part of a word, a longer number, a setting in scientific notation
# (lr 5.5e-3, ε 1e-5: settings, not measurements) or an exponent (64^0.5).
NUMBER = re.compile(r"(?<![\w.^])(\d+\.\d+)(?![\d.]|e[-+]?\d)")

# Numbers rounded from a value a result file prints: number -> [(file under results/, value)].
# One entry per number; where a number appears in several rows, every row's source is listed.
# "(coincidence)": the number is also in the files as text, but as another quantity.
ROUNDED = {
    # anchor rows (report_anchor_*.md, heldout shares by seed)
    "0.80": [("report_anchor_robust.md", "0.8010"),  # robustness: the recipe's best inferential, held out (2,4) seed 2
             ("report_anchor_width_lr.md", "0.8030")],  # width/lr: baseline at d_model 128, symmetric, seed 1
    "0.29": [("report_anchor_phase.md", "0.2885")],  # phase: γ=0.5, depth 4, seed 1
    "0.40": [("report_anchor_phase.md", "0.3995")],  # phase: γ=0.75, depth 2, seed 0
    "0.76": [("report_anchor_phase.md", "0.7550")],  # phase: γ=0.75, depth 4, seed 0
    "0.44": [("report_anchor_phase.md", "0.4380")],  # phase: γ=1, depth 2, seed 1
    "0.68": [("report_anchor_phase.md", "0.6805")],  # phase: γ=1, depth 2, seed 0
    "0.08": [("report_anchor_phase.md", "0.0790")],  # phase: γ=1.25, depth 3, seed 1
    "0.12": [("report_anchor_ablate.md", "0.1180")],  # ablations: the two settings alone, seed 2
    "0.26": [("report_anchor_ablate.md", "0.2610")],  # ablations: the baseline with decay 1.0, seed 0
    "0.35": [("report_anchor_width_lr.md", "0.3460")],  # width/lr: the recipe at d_model 128, seed 2
    "0.53": [("report_anchor_width_lr.md", "0.5325")],  # width/lr: the recipe at lr 3e-3, seed 0
    # the main loss claim: settings sweep (3× grid) and lr_fine_seeds (6 seeds)
    "0.089": [("report_settings.md", "-0.0886")],  # baseline − recipe, 95% interval's low end
    "0.144": [("report_settings.md", "+0.1439")],  # its high end
    "0.067": [("report_lr_fine_seeds.md", "+0.0672")],  # finer grid, 6 seeds, the interval's high end
    "0.004": [("report_lr_fine_seeds.md", "+0.0039")],  # its low end (coincidence: an anchor share)
    # the two settings (report_settings.md at 3e-3, report_settings_fine.md at 5.5e-3)
    "0.034": [("report_settings.md", "-0.0338")],  # ε=1e-5 − recipe, interval's low end
    "0.045": [("report_settings.md", "+0.0450")],  # its high end (coincidence: an anchor share)
    "0.014": [("report_settings_fine.md", "-0.0144"),  # ε=1e-5 − recipe at 5.5e-3, low end (coincidence)
              ("report_gamma_fine_seeds.md", "+0.0140")],  # γ=1 − γ=0.75, low end
    "0.052": [("report_settings_fine.md", "+0.0516"),  # ε=1e-5 − recipe at 5.5e-3, high end (coincidence)
              ("report_settings.md", "+0.0520")],  # no gate − recipe, high end
    "0.025": [("report_settings.md", "-0.0246")],  # no gate − recipe, low end (coincidence; see KNOWN too)
    "0.002": [("report_settings_fine.md", "+0.0018")],  # no gate − recipe at 5.5e-3, seed 0 (coincidence)
    "0.018": [("report_settings.md", "+0.0180")],  # both off − recipe, low end (coincidence)
    "0.113": [("report_settings_fine.md", "-0.1134")],  # no gate − recipe at 5.5e-3, low end
    "0.232": [("report_settings_fine.md", "+0.2323")],  # its high end
    "0.137": [("report_settings_fine.md", "+0.1367")],  # no gate − recipe at 5.5e-3, seed 1
    "0.028": [("report_settings.md", "+0.0281"),  # both off − recipe, high end
              ("report_settings.md", "+0.0277")],  # budget row, 20 tokens per parameter (the settings sweep)
    "0.160": [("report_settings_fine.md", "-0.1597")],  # both off − recipe at 5.5e-3, low end
    "0.440": [("report_settings_fine.md", "+0.4396")],  # its high end
    "0.023": [("report_settings.md", "+0.0231"),  # both off − recipe, mean
              ("report_settings.md", "+0.0232")],  # LayerNorm ε=1e-5 − ε=1e-12, high end
    "0.031": [("report_settings_fine.md", "+0.0315")],  # both off − recipe at 5.5e-3, seed 0 (0.03150 → 0.031)
    "0.270": [("report_settings_fine.md", "+0.2698")],  # both off − recipe at 5.5e-3, seed 1
    # condensation (report_analyses.md: layer 0, mean over 3 seeds)
    "0.10": [("report_analyses.md", "0.1020")],  # recipe wq row cosine, step 0
    "0.36": [("report_analyses.md", "0.3605")],  # recipe wq row cosine, step 40
    "0.17": [("report_analyses.md", "0.1724")],  # baseline wq row cosine, step 320 (0.1476 at step 40)
    "16.5": [("report_analyses.md", "16.5202")],  # recipe wq stable rank, step 0
    "2.3": [("report_analyses.md", "2.3138")],  # recipe wq stable rank, step 40
    "5.5": [("report_analyses.md", "5.5149")],  # baseline wq stable rank, step 320
    "12.2": [("report_analyses.md", "12.1811")],  # recipe w_up stable rank, step 40
    "14.6": [("report_analyses.md", "14.5766")],  # recipe w_up stable rank, step 320
    # γ on the finer grid (report_gamma_fine_seeds.md)
    "0.035": [("report_gamma_fine_seeds.md", "+0.0345")],  # γ=1 − γ=0.5, high end
    "0.02": [("report_gamma_fine_seeds.md", "+0.0208")],  # γ=1's deficit "0.02–0.03": γ=1 − γ=0.5 (coincidence)
    "0.03": [("report_gamma_fine_seeds.md", "+0.0305")],  # ... and γ=1 − γ=0.75 (coincidence: the lr 0.03)
    "0.047": [("report_gamma_fine_seeds.md", "+0.0470"),  # γ=1 − γ=0.75, high end
              ("report_settings.md", "0.0468")],  # budget row, 20 tokens per parameter: the std
    # token budget (report_budget.md; retuned: report_budget_tuned.md)
    "0.438": [("report_budget.md", "-0.4380")],  # 2 tokens per parameter, mean (coincidence)
    "0.062": [("report_budget.md", "0.0615")],  # 2 tokens per parameter, std
    "0.043": [("report_budget.md", "-0.0434")],  # 6 tokens per parameter, mean (coincidence)
    "0.036": [("report_budget.md", "0.0364")],  # 6 tokens per parameter, std
    "0.039": [("report_budget.md", "+0.0386")],  # 40 tokens per parameter, mean
    "0.020": [("report_budget.md", "0.0197")],  # 40 tokens per parameter, std
    "0.350": [("report_budget_tuned.md", "-0.3499")],  # retuned, 2 tokens per parameter, mean
    "0.044": [("report_budget_tuned.md", "0.0436")],  # its std
    "0.084": [("report_budget_tuned.md", "-0.0840")],  # retuned, 6 tokens per parameter, mean
    "0.019": [("report_budget_tuned.md", "0.0191")],  # its std
    "0.064": [("report_budget_tuned.md", "+0.0636")],  # retuned, 40 tokens per parameter, mean
    "0.009": [("report_budget_tuned.md", "0.0089")],  # its std (coincidence)
    "0.042": [("report_budget_tuned.md", "+0.0416")],  # its interval's low end
    "0.086": [("report_budget_tuned.md", "+0.0856")],  # its high end
    # MoE (report_moe.md)
    "0.077": [("report_moe.md", "+0.0768")],  # baseline − recipe, high end (for the main claim's, see KNOWN)
    "0.015": [("report_moe.md", "+0.0148")],  # its low end (coincidence)
    # scale: the fit on the seed means (scaling/mean.json; the scale table prints 1.197 ... 1.010)
    "1.20": [("scaling/mean.json", "1.1970168780510135")],  # d_model 24
    "1.18": [("scaling/mean.json", "1.175003218271886")],  # d_model 32 (and 48)
    "1.01": [("scaling/mean.json", "1.0099676489717582"),  # d_model 64
             ("report_scaling.md", "1.006")],  # the per-seed fit of seed 2
    # the confirmation table (results/README.md "Confirmation runs")
    "0.140": [("report_settings_fine.md", "+0.1399")],  # claim 3's exploration: both off − recipe at 5.5e-3
    "0.51": [("report_confirm_anchor.md", "0.5065")],  # claim 7: the baseline's least symmetric share
    "0.71": [("report_confirm_anchor.md", "0.7140")],  # claim 7: its most symmetric share
    # beyond the paper: the ε regime and claim 1 at emulated scale
    "0.048": [("report_eps_regime.md", "+0.0479")],  # the largest |Δloss| up to r = 1 (d 32, r = 0.1)
    "0.098": [("report_eps_claim1.md", "+0.0980")],  # the recipe's gain over the baseline at d 32
}

# Numbers no result file holds, with where they come from.
KNOWN = {
    # The anchor task's seeds 0–2 ran through the quickstart pipeline (python quickstart.py
    # --seed N), which prints its table and writes no result file under results/; the table is
    # in results/README.md's "The anchor-function task".
    "46.5": "quickstart.py --seed 1, γ=1 inferential share (%)",
    "71.9": "quickstart.py --seed 0, γ=1 inferential share (%)",
    "56.2": "quickstart.py --seed 0, γ=0.5 symmetric share (%)",
    "72.5": "quickstart.py --seed 2, γ=0.5 symmetric share (%)",
    # Computed from a result file's rows, in no report:
    "1.7": "0.0355 / 2.0774 (baseline − recipe over the baseline's loss, report_lr_fine_seeds.md), in %",
    "0.007": "seeds 1–5 of lr_fine_seeds.json, baseline − recipe: +0.0350 ± 0.0337 [−0.0068, +0.0768]",
    "0.077": "the high end of that interval (the MoE row's 0.077 is in ROUNDED)",
    "0.127": "seeds 0–2 of lr_fine_seeds.json, baseline − recipe: +0.0541 ± 0.0293 [−0.0188, +0.1269]",
    "0.019": "the low end of that interval (the budget row's 0.019 is in ROUNDED)",
    "0.021": "both off − recipe at 3e-3 by seed, settings.json: 0.0227, 0.0253, 0.0212 (the range 0.021–0.025)",
    "0.025": "the same range's high end (the no-gate row's 0.025 is in ROUNDED)",
    # The paper's number, not a measurement.
    "1.44": "the paper's effective model size for γ=1",
    # The confirmation table: confirm.md's prediction and its exploration numbers for claim 7,
    # s = inferential − symmetric share by seed of anchor_ablate.json's recipe and baseline.
    "0.04": "claim 1's prediction in confirm.md (+0.01 to +0.04)",
    "0.06": "claim 9's prediction in confirm_wide.md (+0.01 to +0.06)",
    "0.41": "confirm.md's misrounding of recipe seed 1's s (0.4380 − 0.0335 = 0.4045), quoted as such",
    "0.46": "recipe seed 2: 0.4790 − 0.0165 = 0.4625",
    "0.48": "baseline seed 1: 0.0520 − 0.5325 = −0.4805",
    "0.64": "confirm.md's misrounding of baseline seed 2's s (0.0450 − 0.6930 = −0.648), quoted as such",
    "0.65": "baseline seed 2: −0.648",
    # Settings, not measurements.
    "10.5": "the sink search's largest budget in millions of tokens: 1,280 steps x 8,192 = 10,485,760 (report_sink_search.md)",
    "41.94": "the paper's r = ε·d² at d=2048, ε=1e-5 (cpu_lm.sh eps_claim1 sets ε = 41.94/d²)",
}


def result_text():
    paths = glob.glob(os.path.join(RESULTS, "report_*.md")) + glob.glob(os.path.join(RESULTS, "*.json"))
    return "\n".join(open(p).read() for p in sorted(paths))


def table_rows(text, headers):
    """(first cell, row) for every body row of the tables whose header row starts with one of
    `headers`."""
    rows, keep, in_table = [], False, False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        if not in_table:
            in_table, keep = True, line.startswith(headers)
            continue
        if keep and not re.match(r"^\|[-| ]+\|$", line):
            rows.append((line.split("|")[1].strip(), line))
    return rows


def numbers(row):
    # Link targets hold no numbers of the study.
    return NUMBER.findall(re.sub(r"\]\([^)]*\)", "]", row))


def in_text(number, text):
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", text) is not None


def present(text):
    """Every decimal number written in `text`, as written (no sign)."""
    return set(re.findall(r"(?<![\d.])\d+\.\d+", text))


def consistent(number, value):
    """`value` (as printed, maybe itself rounded) rounds to `number`."""
    places = -Decimal(number).as_tuple().exponent
    value_places = max(0, -Decimal(value.lstrip("+-")).as_tuple().exponent)
    slack = Decimal(5).scaleb(-places - 1) + Decimal(5).scaleb(-value_places - 1)
    return abs(abs(Decimal(value)) - Decimal(number)) <= slack


def unexplained(rows, text):
    out, written = [], present(text)
    for label, row in rows:
        for number in numbers(row):
            if number in written or number in ROUNDED or number in KNOWN:
                continue
            out.append(f"{number} in the row '{label}'")
    return out


def test_claims_tables_numbers_come_from_result_files():
    rows = table_rows(open(os.path.join(RESULTS, "README.md")).read(), CLAIMS_HEADERS)
    assert len(rows) >= 19, "the claims tables of results/README.md were not found"
    assert unexplained(rows, result_text()) == []


def test_verdict_table_numbers_come_from_result_files():
    rows = table_rows(open(os.path.join(RESULTS, "README.md")).read(), VERDICT_HEADERS)
    assert len(rows) >= 19, "the verdict table of results/README.md was not found"
    assert unexplained(rows, result_text()) == []


def test_every_listed_rounding_holds_and_every_exception_is_used():
    for number, sources in ROUNDED.items():
        for path, value in sources:
            assert in_text(value.lstrip("+-"), open(os.path.join(RESULTS, path)).read()), (
                f"{number}: {value} is not in results/{path}")
            assert consistent(number, value), f"{number} is not {value} rounded"
    used = set()
    for path, headers in ((os.path.join(RESULTS, "README.md"), CLAIMS_HEADERS),
                          (os.path.join(RESULTS, "README.md"), VERDICT_HEADERS)):
        for _, row in table_rows(open(path).read(), headers):
            used.update(numbers(row))
    assert (set(ROUNDED) | set(KNOWN)) - used == set(), "listed, but in no claims or verdict table"


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation and symbols dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    return {slug(h) for h in re.findall(r"(?m)^#+ (.*)$", text)}


def test_links_between_the_documents_resolve():
    broken = []
    for doc in ("README.md", "results/README.md"):
        for link in re.findall(r"\]\(([^)\s]+)\)", open(os.path.join(ROOT, doc)).read()):
            if re.match(r"\w+://", link):
                continue
            path, _, fragment = link.partition("#")
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else os.path.join(ROOT, doc)
            if not os.path.exists(target) or (fragment and target.endswith(".md") and fragment not in anchors(target)):
                broken.append(f"{doc}: {link}")
    assert broken == []
