"""CT display windows (centre/width in HU) and the HU → uint8 mapping shared by the LVLM
images and the MedSAM2 frames (docs/architecture.md, "Windowing" and "MedSAM2 frames")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from .errors import InputError, shown
from .resources import load_json

# A window's centre and width in HU are at most this large: CT values span about -1024 to
# 30,000 HU, and larger numbers (1e308) would overflow the float32 arithmetic of the mapping.
MAX_HU = 1_000_000.0


@dataclass(frozen=True)
class Window:
    """A display window: HU values in ``[center - width/2, center + width/2]`` map to 0..255."""

    center: float
    width: float
    name: str = "custom"

    def __post_init__(self):
        for name in ("center", "width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise InputError(f"invalid window: the {'centre' if name == 'center' else name} must be a number "
                                 f"of HU, got {_show(v)}")
        if not (abs(self.center) <= MAX_HU and 0 < self.width <= MAX_HU):  # NaN fails too
            raise InputError(f"invalid window centre={_show(self.center)} width={_show(self.width)}: give finite "
                             f"HU values, centre within ±{MAX_HU:,.0f} and width > 0 and at most {MAX_HU:,.0f}")
        # plain floats from here on (a huge int was refused above, so this cannot overflow)
        object.__setattr__(self, "center", float(self.center))
        object.__setattr__(self, "width", float(self.width))

    @property
    def low(self) -> float:
        return self.center - self.width / 2.0

    @property
    def high(self) -> float:
        return self.center + self.width / 2.0


WindowLike = Union[Window, str, tuple, list, None]


def _show(value, limit: int = 24) -> str:
    return shown(value, limit)


def window_presets() -> dict:
    """Preset name → Window, from ``Resources/windows.json``."""
    data = load_json("windows.json")
    return {k: Window(float(v["center"]), float(v["width"]), k) for k, v in data["presets"].items()}


def default_window() -> Window:
    return window_presets()[load_json("windows.json")["default"]]


def get_window(spec: WindowLike = None) -> Window:
    """Resolve a window from a preset name, ``"C,W"`` text, a ``(center, width)`` pair or a Window.

    ``None`` gives the default (soft tissue, 40/400).
    """
    if spec is None:
        return default_window()
    if isinstance(spec, Window):
        return spec
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise InputError(f"a window is (center, width), got {_show(spec, 60)}")
        return Window(spec[0], spec[1])
    if isinstance(spec, str):
        presets = window_presets()
        if spec in presets:
            return presets[spec]
        parts = spec.replace(" ", "").split(",")
        if len(parts) == 2:
            try:
                return Window(float(parts[0]), float(parts[1]))
            except ValueError:
                pass
        raise InputError(
            f"unknown window {_show(spec, 60)}: use a preset ({', '.join(sorted(presets))}) or 'CENTER,WIDTH' in HU"
        )
    raise InputError(f"cannot interpret window {_show(spec, 60)}")


def window_to_uint8(hu: np.ndarray, window: WindowLike = None) -> np.ndarray:
    """``round(255 * (clip(HU, lo, hi) - lo) / width)`` as uint8, any shape."""
    w = get_window(window)
    x = np.clip(np.asarray(hu, dtype=np.float32), w.low, w.high)
    x = (x - np.float32(w.low)) * np.float32(255.0 / w.width)
    return np.rint(x).astype(np.uint8)
