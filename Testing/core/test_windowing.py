"""HU windows (medvolcore.windowing): presets, parsing, and the window's mapping to 8 bits."""

from __future__ import annotations

import numpy as np
import pytest

from medvolcore.errors import InputError
from medvolcore.windowing import Window, get_window, window_presets, window_to_uint8

def test_window_to_uint8_soft_tissue_known_values():
    hu = np.array([-160, 240, 40, -1000, 3000, -159, 0, 100, 239], dtype=np.float32)
    # round(255 * (clip(hu, -160, 240) + 160) / 400): 40 -> 127.5 -> 128 (round half to even)
    # 0 -> 102.0, 100 -> 165.75 -> 166, -159 -> 0.6375 -> 1, 239 -> 254.3625 -> 254
    expected = [0, 255, 128, 0, 255, 1, 102, 166, 254]
    out = window_to_uint8(hu)
    assert out.dtype == np.uint8
    assert out.tolist() == expected
    assert window_to_uint8(hu, "soft_tissue").tolist() == expected
    assert window_to_uint8(hu, (40, 400)).tolist() == expected
    assert window_to_uint8(hu, "40,400").tolist() == expected


def test_window_to_uint8_rounds_half_to_even():
    # width 255 makes the scale exactly 1: values are HU - low, so the halves are exact
    hu = np.array([0.5, 1.5, 2.5, 3.49, 3.51, 254.5], dtype=np.float32)
    assert window_to_uint8(hu, (127.5, 255)).tolist() == [0, 2, 2, 3, 4, 254]


def test_window_to_uint8_keeps_shape_and_accepts_ints():
    a = np.full((3, 4, 5), 240, dtype=np.int32)
    out = window_to_uint8(a)
    assert out.shape == (3, 4, 5) and out.dtype == np.uint8 and (out == 255).all()


def test_window_presets_and_strings():
    presets = window_presets()
    assert presets["lung"].center == -600 and presets["lung"].width == 1500
    assert get_window(None).center == 40 and get_window(None).width == 400
    lung = get_window("lung")
    assert (lung.low, lung.high) == (-1350, 150)
    # lung: round(255 * (hu + 1350) / 1500); -975 -> 63.75 -> 64
    assert window_to_uint8(np.array([-1350, 150, -975, -2000, 500]), "lung").tolist() == [0, 255, 64, 0, 255]
    assert get_window(" -600 , 1500 ") == Window(-600.0, 1500.0)
    assert get_window("50,350").low == 50 - 175
    w = Window(10, 20, "x")
    assert get_window(w) is w


@pytest.mark.parametrize("spec", ["nope", "40", "40,400,1", "a,b", "40,0", "40,-5", (40,), (1, 2, 3), 7, (40, float("nan"))])
def test_invalid_windows(spec):
    with pytest.raises(InputError):
        get_window(spec)


def test_invalid_window_object():
    with pytest.raises(InputError):
        Window(0, 0)


@pytest.mark.probe("II.10", "window (10**400, 400), (1e308, 1e308), ('a', 3), 'nan,400'")
def test_huge_numbers_in_a_window_are_input_errors():
    from medvolcore.windowing import get_window

    for spec in [(10**400, 400), (1e308, 1e308), (40, float("inf")), ("a", 3), "nan,400", "1e400,400", "40,1e308",
                 (40, 0), [True, 400]]:
        with pytest.raises(InputError, match="window"):
            get_window(spec)
    assert get_window((40, 400)) == get_window("40,400") and get_window([-1000, 10**5]).width == 1e5
