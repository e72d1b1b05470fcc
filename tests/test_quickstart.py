"""quickstart.py --smoke end to end: data, two trainings, the anchor benchmark, table and plot."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    # A data folder left by an earlier quickstart with other settings (a full run before this --smoke one, its
    # folder marked): the quickstart rebuilds its own data, as it restarts its own runs.
    subprocess.run([sys.executable, "prepare_data.py", "anchor", "--out", str(out / "data"), "--n-train", "1000",
                    "--n-eval", "128"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    (out / ".quickstart").write_text("made by quickstart.py\n")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "quickstart.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "quickstart.json") as f:
        return out, proc.stdout, json.load(f), elapsed


@pytest.mark.slow
def test_table_printed_with_sane_numbers(smoke):
    out, stdout, result, elapsed = smoke
    assert result["smoke"] is True
    rows = {r["name"]: r for r in result["results"]}
    assert set(rows) == {"gamma05", "gamma1"}
    n_eval = result["data"]["--n-eval"]  # records in each evaluation split
    for r in rows.values():
        # Shares and accuracies are counts of records over n_eval (a wrong denominator or a
        # mean over tokens would not be).
        for key in ("inferential", "symmetric", "other", "seen_pair_acc", "test_key_acc"):
            assert r[key] * n_eval == pytest.approx(round(r[key] * n_eval), abs=1e-6), key
        # A run's wall time covers its training steps (train.py's own clock, summed from the
        # logged tokens and rates) and fits inside the whole quickstart.
        with open(out / r["name"] / "metrics.jsonl") as f:
            logged = [row for row in map(json.loads, f) if "tokens_per_s" in row]
        tokens = [0] + [row["tokens"] for row in logged]
        train_s = sum((b - a) / row["tokens_per_s"] for a, b, row in zip(tokens, tokens[1:], logged))
        assert train_s < r["wall_s"] < elapsed
        # The printed row carries the same numbers as the JSON.
        line = next(line for line in stdout.splitlines() if line.startswith(r["label"]))
        assert f"{r['inferential']:.1%}" in line and f"{r['val_loss']:.3g}" in line
        # Training did something: the last validation loss is below the step-0 one.
        with open(out / r["name"] / "metrics.jsonl") as f:
            val = [row["val_loss"] for row in map(json.loads, f) if "val_loss" in row]
        assert math.isfinite(val[-1]) and val[-1] < val[0] and val[-1] == r["val_loss"]
    # The summary names the machine its wall times come from.
    from report import cpu_name
    assert result["cpu"] == cpu_name() and result["jobs"] >= 1
    assert f"ran on {cpu_name()}, {result['jobs']} training" in stdout
    if importlib.util.find_spec("matplotlib"):
        assert (out / "quickstart.png").stat().st_size > 0
    else:
        assert "plot skipped: matplotlib is not installed" in stdout


@pytest.mark.slow
def test_heldout_shares_match_a_hand_count(smoke):
    """Recount the held-out answers from the trained model with this file's own reading of
    the records: the key is the token before the first anchor (1..4), the pair the two after."""
    from checkpoint import load_model
    from data import read_records
    out, _, result, _ = smoke
    records = read_records(str(out / "data"), "heldout")
    for r in result["results"]:
        model, _ = load_model(str(out / r["name"]), "cpu")
        with torch.no_grad():
            pred = model(torch.as_tensor(records[:, :-1]))[0][:, -1].argmax(-1).numpy()
        counts = {"inferential": 0, "symmetric": 0, "other": 0}
        for rec, p in zip(records, pred):
            i = next(j for j, t in enumerate(rec[:-1]) if 1 <= t <= 4)
            key, pair = int(rec[i - 1]), (int(rec[i]), int(rec[i + 1]))
            assert pair == (4, 3)
            if p == key - 8 - 2:
                counts["inferential"] += 1
            elif p == key - 6:
                counts["symmetric"] += 1
            else:
                counts["other"] += 1
        for kind, n in counts.items():
            assert np.isclose(r[kind], n / len(records)), (r["name"], kind)


def test_table_names_the_cpu():
    import quickstart
    row = {"label": "γ=1 paper recipe", "inferential": 0.5, "symmetric": 0.25, "other": 0.25, "seen_pair_acc": 1.0,
           "test_key_acc": 0.0, "val_loss": 0.1, "wall_s": 12.0}
    lines = quickstart.table([row], "Intel(R) Xeon(R) Test CPU @ 2.00GHz", 2).splitlines()
    assert lines[-1] == "ran on Intel(R) Xeon(R) Test CPU @ 2.00GHz, 2 trainings at a time"
    assert quickstart.table([row], "Apple M2", 1).splitlines()[-1] == "ran on Apple M2, 1 training at a time"
