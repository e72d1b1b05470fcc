"""
The anchor-function task (Zhang, Xu et al., NeurIPS 2024: "Initialization is critical to whether
transformers fit composite functions by reasoning or memorizing"): its rules, the records that
pose it, and the scoring of answers. `prepare_data.py anchor` writes the records as shards;
downstream.py scores a model on them.
"""
from dataclasses import dataclass

import numpy as np

ANCHOR_SHIFTS = {1: 5, 2: 1, 3: -2, 4: -8}  # anchor token -> its single function x + shift
SHIFT = np.zeros(max(ANCHOR_SHIFTS) + 1, np.int64)
SHIFT[list(ANCHOR_SHIFTS)] = list(ANCHOR_SHIFTS.values())
PAIRS = np.array([(a, b) for a in ANCHOR_SHIFTS for b in ANCHOR_SHIFTS], np.int64)  # source id = row


@dataclass
class AnchorTask:
    seq_len: int = 9                 # input tokens per sequence: the paper's length
    keys: tuple = (20, 99)           # key range (inclusive): the paper's
    fillers: tuple = (20, 99)        # filler range: the keys' range, so only the anchors mark the key
    test_key_fraction: float = 0.2   # keys never trained with any pair: seen pairs are tested on them
    heldout: tuple = (4, 3)          # the pair that never appears in training
    mirror_shift: int = -6           # its mirror (3,4) is trained with x-6 instead of the composite x-10
    key_positions: tuple = None      # (LO, HI) positions the key may take; None: anywhere it fits, 0..seq_len-3
    n_train: int = 20000             # 20k samples show the effect in minutes on 2 cores
    n_eval: int = 2000               # per evaluation split: answer shares to about +-1%
    seed: int = 0                    # fixes keys split, positions and fillers: same seed, same bytes

    @property
    def mirror(self):
        return (self.heldout[1], self.heldout[0])

    @property
    def positions(self):
        return tuple(self.key_positions) if self.key_positions is not None else (0, self.seq_len - 3)


def anchor_vocab(task):
    """(vocab_size, eot_id). Targets reach max key + 10 = 109 with the defaults, so ids 0..99 do not
    suffice: the vocab is the largest id + eot, rounded up to a multiple of 64 (128 by default)."""
    top = max(task.keys[1], task.fillers[1], task.keys[1] + max(int(SHIFT[PAIRS].sum(1).max()), task.mirror_shift))
    return -(-(top + 2) // 64) * 64, top + 1


def anchor_targets(task, key, a, b):
    target = key + SHIFT[a] + SHIFT[b]
    mirror = (a == task.mirror[0]) & (b == task.mirror[1])
    return np.where(mirror, key + task.mirror_shift, target)


def anchor_records(task, n, keys, pairs, rng):
    """n records: seq_len inputs (fillers; the key then the pair at a random position) + the target."""
    key = rng.choice(keys, n)
    pair = pairs[rng.integers(len(pairs), size=n)]
    pos = rng.integers(task.positions[0], task.positions[1] + 1, size=n)
    records = rng.integers(task.fillers[0], task.fillers[1] + 1, size=(n, task.seq_len + 1))
    rows = np.arange(n)
    records[rows, pos], records[rows, pos + 1], records[rows, pos + 2] = key, pair[:, 0], pair[:, 1]
    records[:, -1] = anchor_targets(task, key, pair[:, 0], pair[:, 1])
    return records, (pair[:, 0] - 1) * len(ANCHOR_SHIFTS) + pair[:, 1] - 1


def check_anchor_task(task):
    if task.keys[0] > task.keys[1] or task.fillers[0] > task.fillers[1]:
        raise ValueError(f"ranges go LO-HI: keys {task.keys}, fillers {task.fillers}")
    lowest = min(task.keys[0], task.fillers[0])
    if lowest <= max(ANCHOR_SHIFTS):
        raise ValueError(f"keys and fillers must be above the anchor tokens 1..{max(ANCHOR_SHIFTS)}")
    if task.keys[0] + min(int(SHIFT[PAIRS].sum(1).min()), task.mirror_shift) < 0:
        raise ValueError(f"key {task.keys[0]} composed with the anchors goes below token 0; raise the key range")
    if task.seq_len < 3:
        raise ValueError("seq_len must hold the key and the anchor pair (>= 3)")
    if not 0 <= task.positions[0] <= task.positions[1] <= task.seq_len - 3:
        raise ValueError(f"key positions {task.positions[0]}-{task.positions[1]} must lie in 0-{task.seq_len - 3}: "
                         f"the key and its pair must fit in the {task.seq_len} inputs")
    if tuple(task.heldout) not in {tuple(p) for p in PAIRS.tolist()} or task.heldout == task.mirror:
        raise ValueError(f"held-out pair {task.heldout} must be two different anchors from {list(ANCHOR_SHIFTS)}")
    if not 0 < round(task.test_key_fraction * (task.keys[1] - task.keys[0] + 1)) < task.keys[1] - task.keys[0] + 1:
        raise ValueError("test_key_fraction must leave at least one train key and one test key")


def anchor_fields(records):
    """(key, a, b, target) of each record (n, record_len): the pair is the first anchor token and
    the one after it (fillers are never anchors), the key the token before."""
    records = np.asarray(records, np.int64)
    inputs = records[:, :-1]
    first = ((inputs >= 1) & (inputs <= max(ANCHOR_SHIFTS))).argmax(1)
    rows = np.arange(len(records))
    return inputs[rows, first - 1], inputs[rows, first], inputs[rows, first + 1], records[:, -1]


def anchor_answer_kinds(records, predictions, meta):
    """Shares of answers that are inferential (the composite f_b(f_a(x))), symmetric (the rule
    trained on the mirror pair, x + mirror_shift) or other. Meant for the heldout split, with
    `predictions` the model's argmax at the last input position (n,)."""
    key, a, b, _ = anchor_fields(records)
    pred = np.asarray(predictions, np.int64)
    inferential = pred == key + SHIFT[a] + SHIFT[b]
    symmetric = (pred == key + meta["anchor"]["mirror_shift"]) & ~inferential
    return {"inferential": float(inferential.mean()), "symmetric": float(symmetric.mean()),
            "other": float(1 - inferential.mean() - symmetric.mean()), "n": len(pred)}


def anchor_accuracy(records, predictions):
    """Share of answers equal to the stored target (for the train/val/test splits: the trained rule)."""
    return float((np.asarray(predictions, np.int64) == np.asarray(records, np.int64)[:, -1]).mean())
