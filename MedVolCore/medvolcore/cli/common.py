"""What every ``medvol`` command shares: output, the shared options, memory figures, label ids, and the
progress bar on stderr of the commands that run a job."""

from __future__ import annotations

import json
import re
import sys
from typing import List, Optional

from ..errors import InputError

PROG = "medvol"
VOLUME_HELP = "CT file (.nii, .nii.gz, .nrrd, .mha), DICOM folder, or (segment) a DICOMweb series URL"


# What a terminal may act on in printed text: C0 controls (ESC, CR, BS, BEL, …), DEL, C1 controls
# (U+0080–U+009F, CSI among them) and the bidirectional overrides that reorder what is shown.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def _escape(m) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def terminal_safe(text, *, one_line: bool = False) -> str:
    """``text`` with every character a terminal would act on shown as an escape (``\\x1b``,
    ``\\x9b``, ``\\u202e``), so a query, a case id or a file name printed by the CLI cannot
    move the cursor, clear the screen or rewrite what was printed before. Newlines and tabs are
    kept, unless ``one_line`` (error and warning lines): then they are escaped too."""
    return (_UNSAFE_LINE if one_line else _UNSAFE).sub(_escape, str(text))


def emit(result: dict, as_json: bool, text: str) -> None:
    """The command's result on stdout: JSON with ``--json`` (control characters escaped by JSON),
    else the text for people, with :func:`terminal_safe`."""
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        sys.stdout.write(terminal_safe(text) + "\n")


def index_arg(text: str) -> int:
    """argparse ``type`` for slice, pixel and count options: an integer within ±MAX_INDEX, so
    ``--box 0 0 99999999999999999999 5`` is one clear error, not an overflow later."""
    import argparse

    from ..prompts import MAX_INDEX

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text[:30]!r}") from None
    if not -MAX_INDEX <= value <= MAX_INDEX:
        shown = text if len(text) <= 24 else text[:23] + "…"
        raise argparse.ArgumentTypeError(f"{shown} is out of range (at most {MAX_INDEX:,} in size)")
    return value


def seed_arg(text: str) -> int:
    """argparse ``type`` for random seeds: 0 ≤ seed < 2**32 (what every generator here takes)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text[:30]!r}") from None
    if not 0 <= value < 2**32:
        shown = text if len(text) <= 24 else text[:23] + "…"
        raise argparse.ArgumentTypeError(f"{shown} is not a seed (0 to {2**32 - 1})")
    return value


def peak_memory_mb() -> Optional[float]:
    """This process's peak resident memory in MB (None where it cannot be read: Windows)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024, 1)


def parse_labels(values: Optional[List[str]]):
    """``--label 5``, ``--label 2,3`` or ``--label 2 --label 3`` → int or list of ints (None: all)."""
    if not values:
        return None
    ids = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise InputError(f"--label takes integer label ids, got {part!r}") from None
            if n <= 0:
                raise InputError(f"--label ids must be positive (0 is background), got {n}")
            ids.append(n)
    return ids[0] if len(ids) == 1 else ids


def add_stop_option(sp) -> None:
    """``--stop-after-empty K`` (early stop), as every command that propagates has it."""
    from ..propagation import DEFAULT_STOP_AFTER_EMPTY

    sp.add_argument("--stop-after-empty", type=int, default=DEFAULT_STOP_AFTER_EMPTY, metavar="K",
                    help="in each direction, stop once every box's mask has been empty on K consecutive slices "
                         f"(default {DEFAULT_STOP_AFTER_EMPTY}; 0 = propagate through the whole volume, as the paper)")


def add_ct_options(sp) -> None:
    """``--ct-window`` (the display window of the frames the models see) and ``--strict-ct``."""
    sp.add_argument("--ct-window", default=None, metavar="PRESET|C,W",
                    help="display window of the frames the models see: soft_tissue 40/400 (default), lung, bone, … "
                         "or CENTER,WIDTH in HU")
    sp.add_argument("--strict-ct", action="store_true",
                    help="refuse a volume that does not look like CT in HU (no air below -500 HU, or a few whole "
                         "values like a label map) instead of warning in the result and the QC picture")


def add_seg_type_option(sp) -> None:
    """``--seg-type``: the type of a DICOM-SEG (``.dcm``) output."""
    sp.add_argument("--seg-type", choices=["binary", "labelmap"], default="binary",
                    help="a .dcm output's DICOM-SEG type: binary (default: one BINARY frame set per segment, which "
                         "every PACS, viewer and validator takes) or labelmap (one LABELMAP frame set of every "
                         "segment: smaller, but many PACS and viewers do not take it yet)")


def propagate_weights(args) -> tuple:
    """``medvol propagate``'s MedSAM2 weights: ``("checkpoint", path)`` from ``--sam-checkpoint`` or
    from ``--preset``'s downloaded weights, or ``("random", (seed, image_size))`` from
    ``--random-weights`` or a preset of random weights (``tiny``); refused when none is given."""
    if getattr(args, "preset", None) is not None:
        from ..models import resolve

        models = resolve(args.preset, require_adapter=False)
        kind, value = ("checkpoint", models.sam_checkpoint) if models.sam_checkpoint else ("random", models.sam_random)
    elif args.sam_checkpoint is not None:
        kind, value = "checkpoint", args.sam_checkpoint
    elif args.random_weights is not None:
        kind, value = "random", (args.random_weights, args.image_size or 512)
    else:
        raise InputError("no MedSAM2 weights: pass --preset NAME (its downloaded weights: medvol models download "
                         "NAME; tiny for a smoke test), --sam-checkpoint PATH (e.g. MedSAM2_latest.pt), or "
                         "--random-weights SEED for an untrained smoke test")
    if args.image_size not in (None, 512) and args.random_weights is None:
        raise InputError("--image-size applies to --random-weights only; MedSAM2 checkpoints run at 512")
    return kind, value


def add_consensus_options(sp, agreement: Optional[str] = "--agreement") -> None:
    """``--consensus G``, ``--consensus-mask`` and (unless ``agreement`` is None) ``--agreement FILE``."""
    from ..consensus import MASK_MODES

    g = sp.add_argument_group("consensus (how much the model agrees with itself)")
    g.add_argument("--consensus", type=int, default=1, metavar="G",
                   help="answer G times (the greedy answer, then G-1 sampled; G from 1 to 8, 1 = off), propagate "
                        "each, and report their agreement as a confidence in [0, 1] (mean pairwise Dice; not the "
                        "chance that the answer is right)")
    g.add_argument("--consensus-mask", choices=MASK_MODES, default="greedy",
                   help="with --consensus: the mask written is the greedy answer's (default, as without a "
                        "consensus) or the voxels more than half of the samples include (majority)")
    if agreement:
        g.add_argument(agreement, metavar="FILE", default=None,
                       help="with --consensus: also write the agreement map (per voxel, how many of the G samples "
                            "include it, 0..G) on the CT's grid (.nii.gz, .nii, .nrrd, .mha)")


def add_compute_options(sp, dtype: bool = True) -> None:
    """``--threads`` (and ``--grounder-dtype``): how the models use this machine (medvolcore.cpu)."""
    from ..cpu import threads_arg

    sp.add_argument("--threads", type=threads_arg, default=None, metavar="N|auto",
                    help="CPU threads for the models (default auto: the physical cores this process may use, "
                         "less those other work keeps busy; OMP_NUM_THREADS when set)")
    if dtype:
        sp.add_argument("--grounder-dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="the grounder's number format (default auto: bf16 on a GPU and on CPUs with bf16 "
                             "arithmetic in hardware, fp32 on other CPUs)")


def apply_compute_options(args, reserve: int = 0) -> dict:
    """Apply ``--threads`` (medvolcore.cpu.apply_threads); returns what a result records."""
    from ..cpu import apply_threads

    plan = apply_threads(getattr(args, "threads", None), reserve=reserve)
    return {"threads": plan.threads, "threads_rule": plan.describe()}


def add_preset_option(sp) -> None:
    """``--preset NAME``: None unless given, resolved at run time to the manifest's default."""
    sp.add_argument("--preset", default=None,
                    help="model preset (medvol models list); default: the manifest's default preset "
                         "(Resources/models.json or $MEDVOL_MODELS_JSON; `medvol models list` marks it with *)")


def stop_text(propagation: Optional[dict]) -> str:
    """'; stopped early (every mask empty on K slices): forward at 47, backward at 8' when a direction
    ended before the edge of the stack (or window), else '' (``propagation``: the anchor's record)."""
    if not propagation:
        return ""
    parts = [f"{d} at {v['last_slice']}" for d, v in (propagation.get("directions") or {}).items()
             if v.get("stopped_early")]
    return (f"; stopped early (every mask empty on {propagation['stop_after_empty']} slices): " + ", ".join(parts)
            if parts else "")


# ---- progress on stderr -----------------------------------------------------------------

BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {elapsed} < {remaining}  {message}"
_STAGE_WIDTH = 10  # the stage names (read, load, ground, propagate, write) in one column


def bar_line(stage: str, fraction: float, elapsed_s: float, message: str, ncols: int = 100) -> str:
    """The bar's text for one moment of a stage, e.g.
    ``ground     12%|██   | 00:07 < 00:49  decoding 31/256 tokens`` (tqdm draws the bar and
    estimates the time left from the stage's average pace)."""
    from tqdm import tqdm

    return tqdm.format_meter(100 * float(fraction), 100, elapsed_s, ncols=ncols, prefix=stage.ljust(_STAGE_WIDTH),
                             bar_format=BAR_FORMAT, message=terminal_safe(message, one_line=True))


def _bar(desc: str):
    """A progress bar on stderr: the stage, its percent, elapsed time and time left in the stage, and
    its message (none when stderr is not a terminal: :func:`_progress` then writes a line per stage)."""
    from tqdm import tqdm

    class StageBar(tqdm):
        message = ""

        @property
        def format_dict(self):
            return dict(super().format_dict, message=self.message)

    return StageBar(total=100, desc=desc.ljust(_STAGE_WIDTH), file=sys.stderr, disable=None, leave=False,
                    smoothing=0, bar_format=BAR_FORMAT)


def _progress(bar, line_every_s: float = 30.0):
    """The job's ``progress(stage, fraction, message)`` drawn on ``bar`` (None: nothing). Each stage
    restarts the bar's clock, so elapsed and time left are the stage's. When stderr is not a
    terminal (the bar is disabled), one line per stage and one at most every ``line_every_s``."""
    from ..progress import StageClock, clock_text

    clock = StageClock()
    last_line = [0.0]

    def progress(stage, fraction, message):
        if bar is None:
            return
        elapsed, eta, new = clock.update(stage, fraction)
        message = terminal_safe(message, one_line=True)
        if not bar.disable:
            if new:
                bar.reset(total=100)
                bar.set_description_str(stage.ljust(_STAGE_WIDTH), refresh=False)
            bar.n = 100 * float(fraction)
            bar.message = message
            bar.refresh()
        elif new or elapsed - last_line[0] >= line_every_s:
            last_line[0] = 0.0 if new else elapsed
            timing = "" if new else f" ({clock_text(elapsed)} elapsed, about {clock_text(eta)} left)"
            sys.stderr.write(f"{PROG} {stage}: {int(100 * fraction)}%{timing} {message}\n")
            sys.stderr.flush()

    return progress
