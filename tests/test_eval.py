"""eval.py: every analysis against an independent computation (numpy SVD, brute-force loops,
hand-computed probabilities, Monte Carlo), then each subcommand end to end on tiny checkpoints."""
import json
import math
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

import eval as ev
from conftest import tiny_model
from analysis import cosine_stats, row_cosines, stable_rank
from fileio import write_json
from checkpoint import find_checkpoints, load_model
from report import effective_size, fit_power_law, format_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")
EVAL_DATA = os.path.join(DATA, "eval")


# ----------------------------------------------------------------------------- weight structure

@pytest.mark.parametrize("shape", [(7, 5), (5, 9), (32, 32)])
def test_stable_rank_matches_numpy_svd(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    s = np.linalg.svd(w.numpy().astype(np.float64), compute_uv=False)
    assert stable_rank(w) == pytest.approx((s ** 2).sum() / s[0] ** 2, rel=1e-9)


def test_stable_rank_by_hand():
    # Known singular values: U diag(s) V^T with orthonormal U, V. Stable rank sum(s^2) / max(s)^2:
    # 14/9 for (3, 2, 1), exactly 1 for a rank-one matrix.
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(64, 3, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(48, 3, generator=g, dtype=torch.float64))[0]
    assert stable_rank(u @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ v.T) == pytest.approx(14 / 9, rel=1e-12)
    assert stable_rank(torch.outer(u[:, 0], v[:, 0])) == pytest.approx(1.0, rel=1e-12)


def brute_force_cosines(w, threshold):
    w = w.numpy().astype(np.float64)
    values = []
    for i in range(len(w)):
        for j in range(len(w)):
            if i != j:
                values.append(abs(w[i] @ w[j]) / (np.linalg.norm(w[i]) * np.linalg.norm(w[j])))
    return np.mean(values), np.mean(np.array(values) > threshold)


def test_row_cosine_stats_match_brute_force_on_condensed_rows():
    # Rows condensed onto ±two directions plus noise: both statistics are far from 0 and 1.
    g = torch.Generator().manual_seed(1)
    directions = torch.randn(2, 16, generator=g)
    signs = torch.tensor([1.0, -1.0])[torch.randint(2, (24,), generator=g)]
    w = signs[:, None] * directions[torch.randint(2, (24,), generator=g)] + 0.6 * torch.randn(24, 16, generator=g)
    mean_abs, frac = brute_force_cosines(w, 0.7)
    stats = cosine_stats(row_cosines(w), 0.7)
    assert 0.05 < frac < 0.95
    assert stats["mean_abs_cos"] == pytest.approx(mean_abs, rel=1e-9)
    assert stats["frac_cos_gt"] == pytest.approx(frac, abs=1e-12)


def test_row_cosine_subsample_is_an_unbiased_estimate():
    # 40 rows, the first 20 condensed onto one direction: a subsample of 10 rows that was not a
    # uniform random subset (e.g. the first rows) would be biased far above the full statistic.
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 16, generator=g)
    w[:20] = torch.randn(16, generator=g) + 0.3 * torch.randn(20, 16, generator=g)
    full, _ = brute_force_cosines(w, 0.7)
    estimates = []
    for seed in range(300):
        cos = row_cosines(w, max_rows=10, seed=seed)
        assert cos.shape == (10, 10)
        estimates.append(cosine_stats(cos)["mean_abs_cos"])
    assert torch.equal(row_cosines(w, 10, seed=7), row_cosines(w, 10, seed=7))
    assert np.mean(estimates) == pytest.approx(full, abs=4 * np.std(estimates) / math.sqrt(300))
    assert np.std(estimates) > 0.01  # the subsets really differ


def test_stacked_experts_are_analysed_per_expert_with_neurons_on_rows():
    # CONTRACT: experts are (E, d_in, d_out); neuron k of expert e reads w[e][:, k].
    w = torch.randn(3, 5, 4)
    state = {"layers.0.mlp.w_up": w, "layers.0.mlp_norm.weight": torch.ones(5), "lm_head.weight": torch.randn(7, 5)}
    mats = dict(ev.weight_matrices(state))
    assert sorted(mats) == ["layers.0.mlp.w_up[0]", "layers.0.mlp.w_up[1]", "layers.0.mlp.w_up[2]", "lm_head.weight"]
    for e in range(3):
        for k in range(4):
            assert torch.equal(mats[f"layers.0.mlp.w_up[{e}]"][k], w[e][:, k])
    assert ev.matrix_kind("layers.0.mlp.w_up[2]") == "w_up[experts]"
    assert ev.matrix_kind("layers.3.attn.wq.weight") == "wq"


# ----------------------------------------------------------------------------- Δsym and difficulty buckets

def hand_made_pair():
    """Two models' next-token distributions over 4 tokens at 23 positions, and the targets."""
    rng = np.random.default_rng(0)
    p_a = rng.dirichlet(np.ones(4) * 0.7, size=23)
    p_b = rng.dirichlet(np.ones(4) * 0.7, size=23)
    targets = rng.integers(0, 4, size=23)
    rows = np.arange(23)
    return p_a[rows, targets], p_b[rows, targets]


def test_delta_sym_is_the_probability_gap_and_antisymmetric():
    pa, pb = hand_made_pair()
    got = ev.delta_sym(np.log(pa), np.log(pb))
    np.testing.assert_allclose(got, (pa - pb) / (pa + pb), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ev.delta_sym(np.log(pb), np.log(pa)), -got, atol=1e-15)
    # Both probabilities underflow in float64 (e^-1000), the ratio p_A/p_B = e is still exact.
    assert ev.delta_sym([-1000.0], [-1001.0])[0] == pytest.approx((math.e - 1) / (math.e + 1))


def test_difficulty_buckets_match_brute_force():
    pa, pb = hand_made_pair()
    rows = ev.difficulty_buckets(np.log(pa), np.log(pb), n_buckets=5)
    # 23 tokens in 5 equal-count buckets: sizes 5,5,5,4,4, tokens sorted by mean loss.
    loss_a, loss_b = -np.log(pa), -np.log(pb)
    order = sorted(range(23), key=lambda i: (loss_a[i] + loss_b[i]) / 2)
    sizes, start = [5, 5, 5, 4, 4], 0
    for row, size in zip(rows, sizes):
        idx = order[start:start + size]
        start += size
        gaps = [(pa[i] - pb[i]) / (pa[i] + pb[i]) for i in idx]
        assert row["count"] == size
        assert row["mean_delta_sym"] == pytest.approx(np.mean(gaps), rel=1e-10)
        assert row["win_rate_a"] == pytest.approx(np.mean([pa[i] > pb[i] for i in idx]))
        assert row["loss_a"] == pytest.approx(np.mean(loss_a[idx]))
        assert row["loss_b"] == pytest.approx(np.mean(loss_b[idx]))
        assert row["difficulty_hi"] == pytest.approx(max((loss_a[i] + loss_b[i]) / 2 for i in idx))


def test_buckets_locate_gains_on_medium_tokens():
    # A beats B only on tokens of middle difficulty: the table must show it there and only there.
    logp_b = -np.linspace(0.01, 8, 1000)
    logp_a = logp_b.copy()
    middle = (logp_b < -3) & (logp_b > -5)
    logp_a[middle] += 0.3
    rows = ev.difficulty_buckets(logp_a, logp_b)
    gains = [r["mean_delta_sym"] for r in rows]
    assert gains[0] == gains[-1] == 0 and rows[0]["win_rate_a"] == 0.5
    assert max(gains) == pytest.approx(math.tanh(0.15)) and int(np.argmax(gains)) in (4, 5)
    flipped = ev.difficulty_buckets(logp_b, logp_a)
    assert [r["win_rate_a"] for r in flipped] == pytest.approx([1 - r["win_rate_a"] for r in rows])


# ----------------------------------------------------------------------------- scaling fit

def synthetic_scaling(noise, seed, a=400.0, alpha=0.32, c=1.8):
    n = np.geomspace(1e7, 2e9, 7)
    rng = np.random.default_rng(seed)
    return n, a * n ** -alpha + c + noise * rng.standard_normal(len(n))


def test_power_law_fit_recovers_known_parameters():
    n, loss = synthetic_scaling(0.0, 0)
    fit = fit_power_law(n, loss)
    assert fit["alpha"] == pytest.approx(0.32, rel=1e-5)
    assert fit["a"] == pytest.approx(400.0, rel=1e-4)
    assert fit["c"] == pytest.approx(1.8, rel=1e-5)


def test_power_law_uncertainty_matches_monte_carlo_spread():
    # The Jacobian standard error of α must describe how α actually scatters over noise draws.
    fits = [fit_power_law(*synthetic_scaling(0.005, seed)) for seed in range(150)]
    spread = np.std([f["alpha"] for f in fits])
    assert np.median([f["alpha_err"] for f in fits]) == pytest.approx(spread, rel=0.35)
    assert abs(np.mean([f["alpha"] for f in fits]) - 0.32) < 3 * spread / math.sqrt(150) + 0.01


def test_power_law_fit_refuses_edge_exponents_and_increasing_loss():
    n = np.geomspace(1e7, 1e9, 5)
    with pytest.raises(ValueError, match="edge of the searched range"):
        fit_power_law(n, 50.0 * (n / 1e7) ** -5.0 + 2.0)  # α = 5 lies outside [0.01, 3]
    with pytest.raises(ValueError, match="does not decrease with N"):
        fit_power_law(n, 3.0 - 0.5 * (n / 1e7) ** -0.3)  # loss grows with N: a < 0
    with pytest.raises(ValueError, match="at least 3 --baseline"):
        fit_power_law(n[:2], [3.0, 2.9])


def test_three_point_fit_has_no_error_bars_and_writes_standard_json(tmp_path):
    n = np.array([1e7, 1e8, 1e9])
    out = tmp_path / "s.json"
    result = ev.main(["scaling", "--baseline", *[f"{x:g}={400 * x ** -0.32 + 1.8}" for x in n],
                      "--compare", f"1e8={400 * 1.44e8 ** -0.32 + 1.8}", "--json-out", str(out)])
    assert result["summary"]["alpha"] == pytest.approx(0.32, rel=1e-4) and result["summary"]["alpha_err"] is None
    saved = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert saved["summary"]["alpha_err"] is None and saved["fit"]["cov"] is None
    assert saved["rows"][-1]["size_ratio"] == pytest.approx(1.44, rel=1e-3) and saved["rows"][-1]["size_ratio_err"] is None


def test_scaling_reads_loss_jsons_and_counts_nonembedding_params_by_default(tmp_path):
    # Loss follows the law in non-embedding N; a 50k x d embedding is large next to small models.
    sizes = [(2e6, 6.4e6), (8e6, 12.8e6), (3.2e7, 25.6e6), (1.28e8, 51.2e6), (5.12e8, 102.4e6)]
    law = lambda n: 400.0 * n ** -0.32 + 1.8
    baselines = []
    for i, (body, emb) in enumerate(sizes):
        path = tmp_path / f"base{i}.json"
        write_json(path, {"analysis": "loss", "summary": {"loss": law(body), "params_total": body + emb,
                                                            "params_active": body + emb, "params_embedding": emb}})
        baselines.append(str(path))
    compare = tmp_path / "gamma1.json"
    write_json(compare, {"analysis": "loss", "summary": {"loss": law(1.44 * 5e7), "params_total": 5e7 + 4e7,
                                                          "params_active": 5e7 + 4e7, "params_embedding": 4e7}})
    result = ev.main(["scaling", "--baseline", *baselines, "--compare", str(compare)])
    assert result["summary"]["count"] == "nonembedding"
    assert [r["params"] for r in result["rows"]] == [b for b, _ in sizes] + [5e7]
    assert result["summary"]["alpha"] == pytest.approx(0.32, rel=1e-4)
    assert result["rows"][-1]["size_ratio"] == pytest.approx(1.44, rel=1e-4)
    total = ev.main(["scaling", "--baseline", *baselines, "--count", "total"])
    assert [r["params"] for r in total["rows"]] == [b + e for b, e in sizes]
    assert abs(total["summary"]["alpha"] - 0.32) > 0.02  # the embedding bends the law in total N


def test_effective_size_inverts_the_fit():
    n, loss = synthetic_scaling(0.0, 0)
    fit = fit_power_law(n, loss)
    # A run of size 3e8 reaching the loss the baseline law gives at 1.44 x 3e8 is 1.44x "bigger".
    n_eff, _ = effective_size(400.0 * (1.44 * 3e8) ** -0.32 + 1.8, fit)
    assert n_eff / 3e8 == pytest.approx(1.44, rel=1e-4)
    with pytest.raises(ValueError, match="irreducible"):
        effective_size(1.7, fit)


def test_scaling_and_report_commands(tmp_path, capsys):
    n, loss = synthetic_scaling(0.002, 3)
    out = tmp_path / "scaling.json"
    result = ev.main(["scaling", "--baseline", *[f"{a:g}={b:.6f}" for a, b in zip(n, loss)],
                      "--compare", f"1e8={400.0 * 1.44e8 ** -0.32 + 1.8}", "--json-out", str(out)])
    assert result["summary"]["mean_size_ratio"] == pytest.approx(1.44, rel=0.1)
    compare = result["rows"][-1]
    assert 0 < compare["size_ratio_err"] < 0.2
    loss_json = tmp_path / "loss.json"
    write_json(loss_json, {"analysis": "loss", "summary": {"loss": 2.5, "ppl": math.exp(2.5)}, "rows": []})
    report = tmp_path / "report.md"
    ev.main(["report", str(out), str(loss_json), "--out", str(report)])
    text = report.read_text()
    assert "### scaling" in text and "### loss" in text
    header, _, row = [line for line in text.splitlines() if line.startswith("|")][-3:]
    cells = dict(zip(*[[c.strip() for c in line.strip("|").split("|")] for line in (header, row)]))
    assert cells["file"] == "loss.json" and float(cells["ppl"]) == pytest.approx(math.exp(2.5), rel=1e-3)


# ----------------------------------------------------------------------------- generation and sink helpers

def greedy_by_hand(model, idx, n, stop):
    """Greedy decoding by full recomputation, the reference for the KV-cache path."""
    new = []
    for _ in range(n):
        with torch.no_grad():
            new.append(int(model(torch.tensor([idx + new]))[0][0, -1].argmax()))
        if stop(new):
            break
    return new


def test_sample_prints_greedy_decoding_on_a_tiny_checkpoint(tmp_path, capsys):
    model = tiny_model(seed=5, max_seq_len=256)
    ckpt = export(model, tmp_path / "m.pt")
    ev.main(["sample", ckpt, "--prompt", "The cat", "--max-new-tokens", "5", "--temperature", "0"])
    decode = lambda ids: bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
    out = greedy_by_hand(model, list(b"The cat"), 5, lambda t: t[-1] == 256)  # sample ends at end-of-text
    printed = capsys.readouterr().out.split("--- sample 0\n")[1]
    assert printed.rstrip("\n") == ("The cat" + decode(out)).rstrip("\n")


def test_document_starts_match_a_loop():
    eot = 9
    x = torch.tensor([[1, 2, 9, 3, 9, 9, 4, 5], [9, 1, 1, 1, 1, 9, 2, 2]])
    expected = []
    for row in x.tolist():
        start, starts = 0, []
        for t, tok in enumerate(row):
            if t > 0 and row[t - 1] == eot:
                start = t
            starts.append(start)
        expected.append(starts)
    assert ev.document_starts(x, eot).tolist() == expected


def test_format_table_aligns_and_formats():
    text = format_table([{"a": 1, "b": 0.123456}, {"a": 22, "b": None}])
    assert text.splitlines() == [" a       b", " 1  0.1235", "22       -"]


def test_table_cells_with_newlines_stay_on_their_row():
    # bench's rows carry completions, which span lines: shown escaped, as the two characters \n
    rows = [{"ref": "8", "completion": "4*2 = 8.\n\nQ:\r\n"}, {"ref": "7", "completion": "7"}]
    lines = format_table(rows).splitlines()
    assert lines == ["ref" + " " * 10 + "completion", "  8  4*2 = 8.\\n\\nQ:\\r\\n", "  7" + " " * 19 + "7"]
    assert format_table(rows, markdown=True).splitlines()[2] == "| 8 | 4*2 = 8.\\n\\nQ:\\r\\n |"


# ----------------------------------------------------------------------------- tiny checkpoints

BYTES_META = {"tokenizer": "bytes", "vocab_size": 257, "eot_id": 256}


def export(model, path, step=0, data_dir=None, data_meta=BYTES_META, **config):
    """The consolidated layout of `train.py export` (CONTRACT), written directly."""
    from dataclasses import asdict
    torch.save({"model": model.state_dict(), "model_config": asdict(model.cfg), "step": step,
                "config": {"data_dir": data_dir, **config}, "data_meta": data_meta}, path)
    return str(path)


def save_dcp(model, folder, step):
    """A train.py checkpoint folder: DCP files with "model.*" and "optim.*" entries, the rank's
    rng file and meta.json (what checkpoint.checkpoint_problem requires of a complete one)."""
    import torch.distributed.checkpoint as dcp
    from dataclasses import asdict
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # single process on purpose
        dcp.save({"model": model.state_dict(), "optim": {"lr": torch.tensor(1e-3)}}, checkpoint_id=str(folder))
    torch.save({"cpu": torch.get_rng_state(), "cuda": None}, os.path.join(folder, "rng_rank0.pt"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"step": step, "world_size": 1, "config": {}, "model_config": asdict(model.cfg),
                   "data_meta": BYTES_META}, f)
    return str(folder)


def test_one_loading_path_for_exports_dcp_folders_and_run_folders(tmp_path):
    x = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    early, late = tiny_model(seed=1), tiny_model(seed=2)
    for model, step in ((early, 100), (late, 200)):
        save_dcp(model, tmp_path / "run" / f"ckpt_{step:08d}", step)
    # Unfinished saves are never picked: a tmp_ folder, and a ckpt_ folder whose DCP index is
    # missing (a rename that copied, interrupted).
    shutil.copytree(tmp_path / "run" / "ckpt_00000200", tmp_path / "run" / "tmp_ckpt_00000300")
    shutil.copytree(tmp_path / "run" / "ckpt_00000200", tmp_path / "run" / "ckpt_00000400")
    os.remove(tmp_path / "run" / "ckpt_00000400" / ".metadata")
    loaded, info = load_model(str(tmp_path / "run"))
    assert info["step"] == 200 and torch.equal(loaded(x)[0], late(x)[0])
    loaded, info = load_model(export(early, tmp_path / "early.pt", step=100))
    assert info["step"] == 100 and torch.equal(loaded(x)[0], early(x)[0])
    assert [os.path.basename(p) for p in find_checkpoints(str(tmp_path / "run"))] == ["ckpt_00000100", "ckpt_00000200"]
    torch.save({"weights": {}}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a smallinit export"):
        load_model(str(tmp_path / "foreign.pt"))


def test_load_model_builds_on_meta_and_keeps_tied_embeddings(tmp_path, monkeypatch):
    model = tiny_model(seed=6, tie_embeddings=True)
    path = export(model, tmp_path / "tied.pt")
    devices = []
    original = torch.nn.Linear.reset_parameters
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters",
                        lambda self: (devices.append(self.weight.device.type), original(self))[1])
    loaded, _ = load_model(path)
    assert devices and set(devices) == {"meta"}  # no random init ever ran on real memory
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    assert loaded.num_params() == model.num_params()
    x = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(x)[0], model(x)[0])


def uniform_attention_model(**overrides):
    """q = k = 0 makes every score 0: each query attends uniformly over what the mask allows."""
    model = tiny_model(attn_backend="eager", **overrides)
    with torch.no_grad():
        for block in model.layers:
            block.attn.wq.weight.zero_()
            block.attn.wk.weight.zero_()
    return model


def test_sink_share_on_a_model_with_known_attention():
    model = uniform_attention_model()
    x = torch.randint(0, 256, (3, 20))
    expected = np.mean([1 / (q + 1) for q in range(1, 20)])  # query q sees q + 1 tokens
    for layer in ev.sink_shares(model, x):
        np.testing.assert_allclose(layer["first"], [expected] * 2, rtol=1e-6)
        assert "doc_first" not in layer


def test_sink_share_on_document_starts_with_document_masking():
    model = uniform_attention_model(doc_mask=True, eot_id=256)
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    x[0, [5, 11]] = 256
    x[1, [0, 17]] = 256
    # Uniform over the query's own document prefix: share 1/(q - start + 1) on the start;
    # queries that are their document's first token are left out (they trivially score 1).
    shares, firsts = [], []
    for row in x.tolist():
        start = 0
        for q, tok in enumerate(row):
            if q > 0 and row[q - 1] == 256:
                start = q
            if q != start:
                shares.append(1 / (q - start + 1))
            if q >= 1:
                firsts.append(1 / (q + 1) if start == 0 else 0.0)
    for layer in ev.sink_shares(model, x):
        np.testing.assert_allclose(layer["doc_first"], [np.mean(shares)] * 2, rtol=1e-6)
        np.testing.assert_allclose(layer["first"], [np.mean(firsts)] * 2, rtol=1e-6)
    # The chance level eval.py sink reports beside them is the same loop's numbers.
    chance = ev.uniform_shares(x, True, 256)
    assert chance == pytest.approx({"first": np.mean(firsts), "doc_first": np.mean(shares)}, rel=1e-6)
    assert ev.uniform_shares(x, False, 256) == pytest.approx({"first": np.mean([1 / (q + 1) for q in range(1, 24)])}, rel=1e-6)


def set_attention(model, first):
    """Every layer's attention replaced by a known one: head h of layer l puts first[l][h] on the
    first token and spreads the rest evenly over the query's other keys (query 0 sees only
    itself). A hook on probs_tap that returns a tensor replaces its output for the hooks after
    it, so capture_attention sees these probabilities."""
    def hook(layer):
        def replace(module, args, probs):
            T = probs.shape[-1]
            p = torch.zeros_like(probs)
            p[..., 0, 0] = 1.0
            for h, a in enumerate(first[layer]):
                p[:, h, 1:, 0] = a
                for t in range(1, T):
                    p[:, h, t, 1:t + 1] = (1 - a) / t
            return p
        return replace
    return [block.attn.probs_tap.register_forward_hook(hook(i)) for i, block in enumerate(model.layers)]


def test_sink_heads_counts_the_heads_set_above_the_threshold():
    # 2 layers x 4 heads with known first-token shares: 3 of 8 exceed 0.3, 6 of 8 exceed 0.2.
    first = [[0.05, 0.31, 0.29, 0.9], [0.28, 0.6, 0.25, 0.01]]
    model = tiny_model(attn_backend="eager", n_head=4)
    handles = set_attention(model, first)
    try:
        shares = np.array([layer["first"] for layer in ev.sink_shares(model, torch.randint(0, 256, (2, 16)))])
    finally:
        for h in handles:
            h.remove()
    np.testing.assert_allclose(shares, first, rtol=1e-6)
    assert ev.sink_heads(shares, 0.3) == 3 / 8
    assert ev.sink_heads(shares, 0.2) == 6 / 8
    assert ev.sink_heads(shares, 0.95) == 0


def rope64(x, theta):
    """RoPE in float64, written out: channel i and i + d/2 of position t rotate by t * theta^(-2i/d)."""
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def test_sink_heads_match_a_float64_softmax_of_the_queries_and_keys():
    # A model with peaked attention (wq, wk scaled up), document masking and end-of-text tokens;
    # two heads are built to attend to document starts. Each layer's attention recomputed in
    # float64 from its input (a pre-hook on attn), the weights and a mask built by loops; each
    # head's mean share on the first token and on the query's document start, and the share of
    # heads above each threshold between two heads' values.
    model = tiny_model(gamma=0.5, seed=3, attn_backend="eager", n_head=4, doc_mask=True, eot_id=256)
    x = torch.randint(0, 255, (2, 40), generator=torch.Generator().manual_seed(1))
    x[0, [9, 30]] = x[1, 20] = 256
    x[:, 0] = x[0, [10, 31]] = x[1, 21] = 255  # token 255 starts every document, and only there
    with torch.no_grad():
        # Every token carries channel 0, token 255 also channel 1. Channel 7 of a head (with 15,
        # the RoPE pair that turns slowest: 0.013 rad over 40 positions) then gives every query
        # about the same q and only token 255 a key: in layer 0 a score on document starts of
        # about 8 * 5.7 * w^2 / 4 (0.95 of the attention for w = 1; layer 1's input is mixed, so
        # its head needs a larger w, 0.48).
        model.tok_emb.weight[:, 0] += 3
        model.tok_emb.weight[255, 1] += 3
        for layer, head, w in ((0, 1, 1.0), (1, 2, 1.5)):
            attn = model.layers[layer].attn
            for proj, channel in ((attn.wq, 0), (attn.wk, 1)):
                proj.weight.mul_(4)
                proj.weight[[head * 16 + 7, head * 16 + 15]] = 0
                proj.weight[head * 16 + 7, channel] = w
    inputs = []
    handles = [b.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach())) for b in model.layers]
    try:
        layers = ev.sink_shares(model, x)
    finally:
        for h in handles:
            h.remove()
    B, T = x.shape
    starts = []
    for row in x.tolist():
        start, s = 0, []
        for t in range(T):
            if t > 0 and row[t - 1] == 256:
                start = t
            s.append(start)
        starts.append(s)
    allowed = torch.tensor([[[k <= q and k >= starts[b][q] for k in range(T)] for q in range(T)] for b in range(B)])
    ours = {"first": [], "doc_first": []}
    for block, inp in zip(model.layers, inputs):
        attn, H = block.attn, block.attn.n_head
        hd = attn.head_dim
        q = rope64((inp.double() @ attn.wq.weight.double().T).view(B, T, H, hd).transpose(1, 2), attn.rope_theta)
        k = rope64((inp.double() @ attn.wk.weight.double().T).view(B, T, H, hd).transpose(1, 2), attn.rope_theta)
        p = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~allowed[:, None], -math.inf).softmax(-1)
        ours["first"].append([p[:, h, 1:, 0].mean().item() for h in range(H)])
        ours["doc_first"].append([np.mean([p[b, h, t, starts[b][t]].item() for b in range(B) for t in range(T)
                                           if t != starts[b][t]]) for h in range(H)])
    for key, want in ours.items():
        got = np.array([layer[key] for layer in layers])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
        values = np.sort(np.ravel(want))
        assert values[0] < 0.1 and values[-1] > 0.3  # the model really has heads on both sides
        for i in range(1, len(values)):  # every threshold between two heads' values
            threshold = (values[i - 1] + values[i]) / 2
            assert ev.sink_heads(got, threshold) == np.mean(np.array(want) > threshold)


# ----------------------------------------------------------------------------- subcommands end to end

@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """A two-source byte-level dataset (en, zh) made by prepare_data.py's command line."""
    import subprocess
    import sys
    folder = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = {"en": "the cat sat on a mat and the dog ran far away".split(), "zh": ["山", "水", "月", "花", "风", "云"]}
    for name, vocab in words.items():
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(80):
                f.write(json.dumps({"text": " ".join(rng.choice(vocab, 30))}, ensure_ascii=False) + "\n")
    subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "text", "--out", str(folder / "data"),
                    "--source", f"en={folder / 'en.jsonl'}", "--source", f"zh={folder / 'zh.jsonl'}",
                    "--tokenizer", "bytes", "--val-fraction", "0.2", "--workers", "1"], check=True, capture_output=True)
    return str(folder / "data")


DATA_ARGS = ["--tokens", "512", "--batch-size", "4", "--seq-len", "32"]


def val_batches_again(data, n):
    from data import TokenLoader
    loader = TokenLoader(data, "val", 4, 32, seed=0)
    return [loader.next_batch(with_sources=True) for _ in range(n)]


def target_probs(model, x, y):
    with torch.no_grad():
        p = torch.softmax(model(x)[0].double(), -1)
    return p.gather(2, y.clamp_min(0)[..., None]).squeeze(2)


def test_loss_per_source_matches_a_manual_computation(tmp_path, text_data):
    model = tiny_model(seed=3)
    result = ev.main(["loss", export(model, tmp_path / "m.pt"), "--data", text_data, *DATA_ARGS,
                      "--json-out", str(tmp_path / "loss.json")])
    losses = {"en": [], "zh": []}
    for x, y, src in val_batches_again(text_data, 4):  # 512 tokens / (4 x 32)
        p = target_probs(model, x, y)
        for b, t in zip(*torch.nonzero(y >= 0, as_tuple=True)):
            losses[["en", "zh"][src[b, t]]].append(-math.log(p[b, t]))
    rows = {r["source"]: r for r in result["rows"]}
    for name, values in losses.items():
        assert rows[name]["tokens"] == len(values)
        assert rows[name]["loss"] == pytest.approx(np.mean(values), rel=1e-5)
    assert result["summary"]["loss"] == pytest.approx(np.mean(losses["en"] + losses["zh"]), rel=1e-5)
    assert json.load(open(tmp_path / "loss.json"))["summary"]["tokens"] == 512


def test_loss_defaults_to_the_runs_seq_len_capped_at_max_seq_len(tmp_path, text_data):
    from data import TokenLoader
    model = tiny_model(seed=3)
    summary = ev.main(["loss", export(model, tmp_path / "m.pt", seq_len=16), "--data", text_data,
                       "--tokens", "256", "--batch-size", "4"])["summary"]
    assert (summary["seq_len"], summary["split"], summary["tokens"]) == (16, "val", 256)
    loader = TokenLoader(text_data, "val", 4, 16, seed=0)
    losses = []
    for _ in range(4):  # 256 tokens / (4 x 16)
        x, y = loader.next_batch()
        losses += (-target_probs(model, x, y).log())[y >= 0].tolist()
    assert summary["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    # Trained at 2048, window of 24: scored at 24 instead of crashing.
    short = tiny_model(seed=3, max_seq_len=24)
    summary = ev.main(["loss", export(short, tmp_path / "s.pt", seq_len=2048), "--data", text_data,
                       "--tokens", "96", "--batch-size", "4"])["summary"]
    assert summary["seq_len"] == 24 and summary["tokens"] == 96


def test_loss_of_a_diverged_checkpoint_has_infinite_perplexity(tmp_path, text_data, capsys):
    # Diverged but finite: an lm_head 1e4 times too large gives losses in the thousands, whose
    # e^loss is past the largest float (e^709.8).
    model = tiny_model(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    out = tmp_path / "loss.json"
    result = ev.main(["loss", export(model, tmp_path / "m.pt"), "--data", text_data, *DATA_ARGS, "--json-out", str(out)])
    losses = []
    for x, y, _ in val_batches_again(text_data, 4):
        with torch.no_grad():
            logp = torch.log_softmax(model(x)[0].double(), -1).gather(2, y.clamp_min(0)[..., None]).squeeze(2)
        losses += (-logp)[y >= 0].tolist()
    assert 710 < result["summary"]["loss"] < math.inf
    assert result["summary"]["loss"] == pytest.approx(np.mean(losses), rel=1e-4)
    assert result["summary"]["ppl"] == math.inf and all(r["ppl"] == math.inf for r in result["rows"])
    assert "inf" in capsys.readouterr().out.splitlines()[1].split()
    assert json.loads(out.read_text())["summary"]["ppl"] is None  # standard JSON has no Infinity


def run_expecting_error(argv, capsys, *fragments):
    with pytest.raises(SystemExit) as exit_info:
        ev.main(argv)
    err = capsys.readouterr().err.strip().splitlines()  # a progress bar may come before
    assert exit_info.value.code == 2 and err[-1].startswith("error: ")
    assert not any(line.startswith(("error", "Traceback")) for line in err[:-1])
    for fragment in fragments:
        assert fragment in err[-1]


def test_bad_input_ends_in_one_line_naming_the_fix(tmp_path, text_data, capsys):
    ckpt = export(tiny_model(), tmp_path / "m.pt")
    run_expecting_error(["loss", ckpt, "--data", str(tmp_path / "nowhere")], capsys, "nowhere", "--data")
    run_expecting_error(["loss", str(tmp_path / "nothing.pt"), "--data", text_data], capsys, "nothing.pt")
    run_expecting_error(["tokens", ckpt, ckpt, "--data", text_data, "--tokens", "64", "--batch-size", "2",
                         "--seq-len", "16", "--buckets", "1000"], capsys, "buckets", "--tokens")
    run_expecting_error(["scaling", "--baseline", "1e6=4", "2e6=3.5"], capsys, "at least 3")
    run_expecting_error(["scaling", "--baseline", "1e6=4", "2e6=3.6", "4e6=3.3", "8e6=3.1", "--compare", "1e7=1.0"],
                        capsys, "irreducible")


@pytest.mark.parametrize("argv", [
    ["loss", "m.pt", "--batch-size", "0"], ["loss", "m.pt", "--tokens", "0"], ["sink", "m.pt", "--seq-len", "-3"],
    ["tokens", "a.pt", "b.pt", "--buckets", "0"], ["weights", "a.pt", "--max-rows", "1"],
    ["residual", "--init", "--widths", "0"], ["sample", "m.pt", "--max-new-tokens", "0"],
    ["sample", "m.pt", "--num-samples", "0"], ["sample", "m.pt", "--top-k", "0"],
    ["bench", "m.pt", "--task", "gsm8k", "--limit", "0"], ["bench", "m.pt", "--task", "gsm8k", "--shots", "-1"],
    ["bench", "m.pt", "--task", "gsm8k", "--max-new-tokens", "0"], ["bench", "m.pt", "--task", "gsm8k", "--num-samples", "0"],
    ["bench", "m.pt", "--task", "gsm8k", "--top-k", "0"],
])
def test_size_and_count_flags_are_refused_below_their_minimum_when_parsed(argv, capsys):
    # --batch-size 0 divided by zero and --tokens 0 read a batch anyway; 0 shots is zero-shot, and
    # a cosine needs two rows.
    flag, bad = argv[-2:]
    minimum = {"--shots": 0, "--max-rows": 2}.get(flag, 1)
    args = ev.build_parser().parse_args(argv[:-1] + [str(minimum)])
    assert getattr(args, flag[2:].replace("-", "_")) in (minimum, [minimum])
    with pytest.raises(SystemExit) as exit_info:
        ev.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {flag}: must be >= {minimum} (got {bad})")


@pytest.mark.parametrize("flag,value", [("--split", "test"), ("--tokens", "512"), ("--batch-size", "4"),
                                        ("--seq-len", "32")])
def test_bench_refuses_the_batch_flags_it_would_ignore(flag, value, capsys):
    # bench scores whole records (anchor) or published items: a token budget, batch size,
    # length or split would change nothing, so they are not accepted rather than ignored.
    bench = ["bench", "m.pt", "--task", "anchor", "--data", "data/anchor"]
    assert ev.build_parser().parse_args(bench).data == "data/anchor"
    with pytest.raises(SystemExit) as exit_info:
        ev.build_parser().parse_args(bench + [flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: unrecognized arguments: {flag} {value}")
    # The analyses that read batches keep them.
    assert str(getattr(ev.build_parser().parse_args(["loss", "m.pt", flag, value]), flag[2:].replace("-", "_"))) == value


def test_data_the_model_does_not_fit_is_refused_in_one_line(tmp_path, text_data, capsys):
    # train.py's check (data.check_model_vocab) before any data is read. A gpt2 model on
    # byte data scored a silent loss near ln(50304); a model whose vocab is smaller than the data's
    # died of an IndexError in its embedding.
    gpt2 = export(tiny_model(vocab_size=50304), tmp_path / "g.pt",
                  data_meta={"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256})
    byte = export(tiny_model(), tmp_path / "b.pt")
    for command in ("loss", "sink", "residual"):
        run_expecting_error([command, gpt2, "--data", text_data, *DATA_ARGS], capsys,
                            f"{text_data} does not fit checkpoint {gpt2}", "tokenized with 'bytes'", "--tokenizer gpt2")
    run_expecting_error(["tokens", byte, gpt2, "--data", text_data, *DATA_ARGS], capsys, f"checkpoint {gpt2}")
    small = export(tiny_model(vocab_size=200), tmp_path / "s.pt")  # the data holds UTF-8 bytes >= 200
    run_expecting_error(["loss", small, "--data", text_data, *DATA_ARGS], capsys, "vocab_size=200", "set vocab_size >= 257")
    gpt2_data = tmp_path / "gpt2_data"  # byte shards under a meta.json that says gpt2
    shutil.copytree(text_data, gpt2_data)
    meta = json.loads((gpt2_data / "meta.json").read_text())
    (gpt2_data / "meta.json").write_text(json.dumps({**meta, "tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256}))
    run_expecting_error(["loss", byte, "--data", str(gpt2_data), *DATA_ARGS], capsys, "tokenized with 'gpt2'",
                        "--tokenizer bytes")
    assert ev.main(["loss", gpt2, "--data", str(gpt2_data), *DATA_ARGS])["summary"]["tokens"] == 512  # they fit


def test_every_argument_of_every_subcommand_has_help():
    from test_sweep import actions_without_help
    assert actions_without_help(ev.build_parser()) == []


def test_tokens_compares_two_checkpoints_on_identical_tokens(tmp_path, text_data):
    a, b = tiny_model(gamma=1.0, seed=1), tiny_model(gamma=0.5, seed=2)
    result = ev.main(["tokens", export(a, tmp_path / "a.pt"), export(b, tmp_path / "b.pt"), "--data", text_data, *DATA_ARGS])
    gaps = []
    for x, y, _ in val_batches_again(text_data, 4):
        pa, pb = target_probs(a, x, y), target_probs(b, x, y)
        gaps += ((pa - pb) / (pa + pb))[y >= 0].tolist()
    assert result["summary"]["tokens"] == len(gaps) == sum(r["count"] for r in result["rows"])
    assert result["summary"]["mean_delta_sym"] == pytest.approx(np.mean(gaps), rel=1e-5, abs=1e-9)
    assert result["summary"]["win_rate_a"] == pytest.approx(np.mean(np.array(gaps) > 0))
    assert [r["bucket"] for r in result["rows"]] == list(range(10))


def test_sink_command_on_a_checkpoint_with_uniform_attention(tmp_path, text_data):
    ckpt = export(uniform_attention_model(), tmp_path / "u.pt")
    result = ev.main(["sink", ckpt, "--data", text_data, *DATA_ARGS])
    expected = np.mean([1 / (q + 1) for q in range(1, 32)])  # 0.099
    assert len(result["rows"]) == 4  # 2 layers x 2 heads
    assert all(r["share_first"] == pytest.approx(expected, rel=1e-5) for r in result["rows"])
    # Uniform attention is the chance level itself; no head exceeds 0.3, every head exceeds 0.09.
    assert result["summary"]["uniform_share_first"] == pytest.approx(expected, rel=1e-6)
    assert result["summary"]["sink_heads_first"] == 0 and result["summary"]["threshold"] == 0.3
    low = ev.main(["sink", ckpt, "--data", text_data, *DATA_ARGS, "--threshold", "0.09"])["summary"]
    assert low["sink_heads_first"] == 1 and low["threshold"] == 0.09


def test_residual_command_attributes_branches_correctly(tmp_path, text_data):
    model = tiny_model()
    with torch.no_grad():
        model.layers[1].attn.wo.weight.zero_()  # layer 1 adds no attention update
    result = ev.main(["residual", export(model, tmp_path / "r.pt"), "--data", text_data, *DATA_ARGS])
    rows = result["rows"]
    assert rows[1]["attn_ratio"] == 0 and rows[0]["attn_ratio"] > 0
    assert all(r["mlp_ratio"] > 0 and r["resid_rms"] > 0 for r in rows)


@pytest.mark.parametrize("mlp,gamma,mlp_exponent", [("gelu", 0.5, 0.5), ("gelu", 1.0, 0.0), ("swiglu", 1.0, -0.5)])
def test_residual_exponent_at_init_follows_the_theory(mlp, gamma, mlp_exponent):
    # Issue 2's derivation: attention and gelu branch / residual ~ d^(1-γ); SwiGLU's bilinear
    # product adds d^(0.5-γ), so d^(1.5-2γ).
    result = ev.main(["residual", "--init", "--widths", "64", "128", "256", "--gamma", str(gamma), "--mlp", mlp,
                      "--batch-size", "2", "--seq-len", "32"])
    assert result["summary"]["attn_ratio_block0_exponent"] == pytest.approx(1 - gamma, abs=0.1)
    assert result["summary"]["mlp_ratio_block0_exponent"] == pytest.approx(mlp_exponent, abs=0.1)


def test_weights_trajectory_over_a_run_and_moe_experts(tmp_path):
    for step, seed in ((10, 1), (20, 2)):
        save_dcp(tiny_model(seed=seed), tmp_path / "run" / f"ckpt_{step:08d}", step)
    result = ev.main(["weights", str(tmp_path / "run"), "--json-out", str(tmp_path / "w.json")])
    assert [t["step"] for t in result["trajectory"]] == [10, 20]
    final = tiny_model(seed=2)
    wq = final.layers[1].attn.wq.weight.detach().double().numpy()
    s = np.linalg.svd(wq, compute_uv=False)
    row = next(r for r in result["matrices"] if r["name"] == "layers.1.attn.wq.weight")
    assert row["stable_rank"] == pytest.approx((s ** 2).sum() / s[0] ** 2, rel=1e-6)
    moe = tiny_model(n_experts=4, top_k=2, moe_impl="reference")
    result = ev.main(["weights", export(moe, tmp_path / "moe.pt")])
    kinds = {r["kind"]: r["matrices"] for r in result["rows"]}
    assert kinds["w_up[experts]"] == 2 * 4 and kinds["router"] == 2


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("matplotlib") is None,
                    reason="matplotlib is an optional dependency of eval.py plots")
def test_plots_are_written(tmp_path, text_data):
    a, b = export(tiny_model(seed=1), tmp_path / "a.pt"), export(tiny_model(seed=2), tmp_path / "b.pt")
    ev.main(["tokens", a, b, "--data", text_data, *DATA_ARGS, "--plot", str(tmp_path / "tokens.png")])
    ev.main(["weights", a, b, "--plot", str(tmp_path / "traj.png"), "--heatmap", str(tmp_path / "heat.png")])
    ev.main(["scaling", "--baseline", "1e6=4", "2e6=3.6", "4e6=3.3", "8e6=3.1", "--plot", str(tmp_path / "s.png")])
    for name in ("tokens.png", "traj.png", "heat.png", "s.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
