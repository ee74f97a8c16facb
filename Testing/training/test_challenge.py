"""The CVPR 2025 challenge files (``medvoltrain.challenge``): read as they are, written back, and
refused in one line when malformed or when their pickled prompts would run code."""

from __future__ import annotations

import numpy as np
import pytest

from medvoltrain import challenge
from medvoltrain.errors import DataError


class _Boom:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_a_prompt_file_that_would_run_code_is_refused(tmp_path):
    np.savez(tmp_path / "evil.npz", imgs=np.zeros((2, 2, 2)), spacing=np.ones(3),
             text_prompts=np.array({"1": _Boom()}, dtype=object))
    with pytest.raises(DataError, match="not allowed"):
        challenge.read_image(tmp_path / "evil.npz")


@pytest.mark.parametrize("kwargs, words", [
    ({"spacing": np.array([1.0, 0.0, 1.0])}, "spacing must be three positive"),
    ({"text_prompts": {"300": "x", "instance_label": 0}}, "outside 1–255"),
    ({"text_prompts": {"1": "x", "instance_label": 2}}, "must be 0 or 1"),
    ({"text_prompts": {"instance_label": 0}}, "no class prompt"),
    ({"imgs": np.zeros((4, 4))}, "3-D numeric"),
])
def test_malformed_challenge_files_are_one_line(tmp_path, kwargs, words):
    fields = {"imgs": np.zeros((2, 3, 4)), "spacing": np.ones(3), "text_prompts": {"1": "liver", "instance_label": 0}}
    fields.update(kwargs)
    np.savez(tmp_path / "c.npz", **fields)
    with pytest.raises(DataError, match=words):
        challenge.read_image(tmp_path / "c.npz")


def test_a_written_case_reads_back(tmp_path):
    challenge.write_image(tmp_path / "c.npz", np.arange(24).reshape(2, 3, 4), (2.0, 0.5, 0.7), {3: "a", 12: "b"},
                          instance=True)
    im = challenge.read_image(tmp_path / "c.npz")
    assert (im.prompts, im.instance, im.spacing, im.imgs.shape) == ({3: "a", 12: "b"}, True, (2.0, 0.5, 0.7),
                                                                    (2, 3, 4))
