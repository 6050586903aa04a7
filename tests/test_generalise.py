"""benchmarks/generalise.py: the digits written as a grey image folder, and the data sets it knows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from test_benchmarks_page import _module

from anytime.data.imagefolder import scan_folder


def test_the_digits_become_a_grey_28px_folder_with_a_held_out_test_split(tmp_path):
    generalise = _module("generalise")
    root = generalise.write_digit_folder(tmp_path / "digits")
    scan = scan_folder(root)
    assert scan.classes == tuple(str(d) for d in range(10))
    assert (len(scan.train), len(scan.test)) == (1438, 359)
    with Image.open(root / scan.train[0][0]) as picture:
        assert picture.mode == "L" and picture.size == (28, 28)
        assert np.asarray(picture).max() > 128  # ink, not a blank page
    tests = np.bincount([label for _, label in scan.test], minlength=10)
    assert tests.min() >= 34 and tests.max() <= 38  # stratified: ~20% of every digit
    assert [p.name for p in tmp_path.iterdir()] == ["digits"]  # no temporary folder left beside it
    assert generalise.write_digit_folder(root) == root  # written once


def test_data_sets_named_on_the_command_line_join_the_rows():
    generalise = _module("generalise")
    sets = generalise.data_sets([Path("/x/imgs")], [Path("/y/texts")])
    names = [d.name for d in sets]
    assert names[:2] == ["digits", "digits-grey28"] and names[-2:] == ["folder-imgs", "text-texts"]
    assert sets[-1].flags == ("--data", "textfolder", "--data-root", "/y/texts")
