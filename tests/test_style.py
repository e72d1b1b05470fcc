"""The project's line limit: people fork these files and read them side by side, so no line of the top-level
scripts or results/ goes past 120 characters (counted as characters, not UTF-8 bytes: ε and Δ are one each)."""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 120


def test_no_line_over_limit():
    paths = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "results", "*.py")))
    assert paths, "no .py files found next to tests/"
    long = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                width = len(line.rstrip("\r\n"))
                if width > LIMIT:
                    long.append(f"{os.path.relpath(path, ROOT)}:{n} ({width} chars)")
    assert not long, f"lines over {LIMIT} characters:\n" + "\n".join(long)
