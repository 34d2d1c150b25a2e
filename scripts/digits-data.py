#!/usr/bin/env python3
"""The 8x8 handwritten digits of the vision-transformer example (examples/vit).

Converts scikit-learn's bundled copy of the UCI "Optical Recognition of Handwritten Digits"
test set (`sklearn.datasets.load_digits()`: 1,797 images of 8x8 pixels valued 0..16, labels
0..9; shipped inside scikit-learn, so no download) to the compact binary the Rust loader reads:
1,797 records of 65 bytes, the 64 pixels row by row then the label. The output is
deterministic (the images in scikit-learn's order).

Usage (any Python with scikit-learn, e.g. the venv /work/.venv-hf):

    python scripts/digits-data.py [--out examples/vit/data/digits.bin]
"""

import argparse
import hashlib
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

RECORD = 65


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("examples/vit/data/digits.bin"))
    args = p.parse_args()

    d = load_digits()
    images = np.asarray(d.images)
    labels = np.asarray(d.target)
    assert images.shape == (1797, 8, 8), images.shape
    assert labels.shape == (1797,), labels.shape
    assert images.min() >= 0 and images.max() <= 16, (images.min(), images.max())
    assert np.all(images == np.round(images)), "pixels are whole numbers"
    assert labels.min() >= 0 and labels.max() <= 9

    records = np.zeros((len(labels), RECORD), dtype=np.uint8)
    records[:, :64] = images.reshape(len(labels), 64).astype(np.uint8)
    records[:, 64] = labels.astype(np.uint8)
    data = records.tobytes()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    counts = np.bincount(labels, minlength=10).tolist()
    print(f"{args.out}: {len(labels)} images, {len(data)} bytes, per class {counts}")
    print(f"sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
