"""Loads what `nextstate export` wrote with Hugging Face `datasets`, as a trainer would, and prints
one JSON object: per output, its row count, columns, feature types and first record.

Usage: export_check.py NAME=PATH ...   (PATH: a .parquet file, or a dataset folder with a README.md card)
"""
import json
import os
import sys

import datasets


def ftype(f):
    """A feature's type as a short string: int32, string, list<int32>, struct<role:string,...>."""
    if isinstance(f, datasets.Value):
        return f.dtype
    if isinstance(f, dict):
        return "struct<" + ",".join(f"{k}:{ftype(v)}" for k, v in f.items()) + ">"
    if isinstance(f, list):
        return "list<" + ftype(f[0]) + ">"
    inner = getattr(f, "feature", None)
    if inner is not None:
        return "list<" + ftype(inner) + ">"
    return type(f).__name__


def load(path):
    if os.path.isdir(path):
        # the folder's README.md card names the data files (configs / data_files)
        return datasets.load_dataset(path, split="train")
    return datasets.load_dataset("parquet", data_files=path, split="train")


def main():
    out = {}
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        ds = load(path)
        out[name] = {
            "num_rows": ds.num_rows,
            "columns": ds.column_names,
            "features": {k: ftype(v) for k, v in ds.features.items()},
            "first": ds[0] if ds.num_rows else None,
        }
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
