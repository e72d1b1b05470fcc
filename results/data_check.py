"""Is a prepared data folder the study's data? `bash results/cpu_lm.sh data` and `bash
results/anchor.sh data` call this after building each data set.

    python results/data_check.py DIR NAME            # compare with results/data.json[NAME]; exit 1 if different
    python results/data_check.py DIR NAME --record   # write that entry (once, when a data set joins the study)

The comparison reads the bytes, not meta.json's cached hashes: each corpus file the command read
(the --source globs recorded in meta.json, relative to the repo root) and each shard. A changed
corpus file is named first, as it is the cause; a shard that differs with the same corpus names
the shard (another tokenizer version, another prepare_data.py).
"""
import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from data import data_fingerprint  # noqa: E402
from fileio import atomic_write_bytes, sha256_file  # noqa: E402

RECORD = os.path.join(ROOT, "results", "data.json")


def fingerprint(data_dir):
    """What the study records of a data set: the corpus files read, every shard, and the loader's
    data fingerprint (data.data_fingerprint, which every result row names), all from bytes."""
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    sources = {}
    for spec in meta.get("settings", {}).get("sources", []):  # the anchor task is generated: no sources
        pattern = os.path.join(ROOT, spec["path"])
        # named below the glob's fixed part ("en: gutenberg/moby_dick.txt"), so a kit elsewhere compares too
        parts = pattern.split(os.sep)
        base = os.sep.join(parts[:next(i for i, part in enumerate(parts + ["*"]) if glob.has_magic(part))])
        for path in sorted(glob.glob(pattern, recursive=True)):
            sources[f"{spec['name']}: {os.path.relpath(path, base)}"] = sha256_file(path)
    shards = {name: sha256_file(os.path.join(data_dir, name))
              for info in meta["splits"].values() for name in info["shards"]}
    # shard_sha256 is left out: the shards are hashed from the files
    uncached = {**meta, "splits": {split: {k: v for k, v in info.items() if k != "shard_sha256"}
                                   for split, info in meta["splits"].items()}}
    return {"sources": sources, "shards": shards, "data_fingerprint": data_fingerprint(data_dir, uncached)}


def differences(want, have):
    """The first difference, as the sentence that names it, or None."""
    for kind, fix in (("sources", "restore the offline kit's file (sha256sum -c SHA256SUMS in the kit)"),
                      ("shards", "rebuild with the documented command at the study's commit")):
        for name in sorted(set(want[kind]) | set(have[kind])):
            if name not in have[kind]:
                return f"{kind[:-1]} {name} is missing (the study read it): {fix}"
            if name not in want[kind]:
                return f"{kind[:-1]} {name} was not in the study's data: {fix}"
            if want[kind][name] != have[kind][name]:
                return (f"{kind[:-1]} {name} differs from the study's (sha256 {have[kind][name][:12]}, "
                        f"results/data.json has {want[kind][name][:12]}): {fix}")
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir", help="a prepared folder (prepare_data.py)")
    p.add_argument("name", help="its entry in results/data.json (bi_bytes, anchor, ...)")
    p.add_argument("--record", action="store_true", help="write the entry instead of comparing with it")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.data_dir, "meta.json")):
        sys.exit(f"error: {args.data_dir} has no meta.json: build it first (prepare_data.py)")
    have = fingerprint(args.data_dir)
    record = {}
    if os.path.exists(RECORD):
        with open(RECORD) as f:
            record = json.load(f)
    if args.record:
        record[args.name] = have
        atomic_write_bytes(RECORD, [(json.dumps(record, indent=1, sort_keys=True) + "\n").encode()])
        print(f"{args.name}: recorded data fingerprint {have['data_fingerprint']}")
        return
    if args.name not in record:
        sys.exit(f"error: results/data.json has no entry {args.name!r}; it has {sorted(record)}")
    problem = differences(record[args.name], have)
    if problem:
        sys.exit(f"error: {args.data_dir} is not the study's {args.name} data: {problem}")
    print(f"{args.name}: {args.data_dir} is the study's data (fingerprint {have['data_fingerprint']})")


if __name__ == "__main__":
    main()
