"""How sure the model was, for the panel: the consensus option, the confidence line and the
agreement level (plain values; the logic puts them in MRML; the agreement segment's name is
:func:`.segments.agreement_segment_name`).

With a consensus of G answers the worker returns ``confidence`` (the samples' mean pairwise Dice,
with "not present" answers counted: ``medvolcore.consensus``), ``samples`` and, when asked for a
path, the agreement map (per voxel how many of the G samples include it). Without one it returns
the answer's token signal ``answer_mean_prob``. Neither is the chance that the answer is right,
and every text here says so.
"""

from __future__ import annotations

from typing import Optional

MAX_CONSENSUS = 8  # = medvolcore.grounder.MAX_SAMPLES (a test checks they agree)


def check_consensus(value) -> int:
    """The panel's number of samples, 1 (off) to :data:`MAX_CONSENSUS`; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONSENSUS:
        raise ValueError(f"the consensus takes 1 to {MAX_CONSENSUS} samples (1 = off), got {value!r}")
    return value


def agreement_level(samples: int) -> int:
    """The agreement segment shows the voxels at least this many of the G samples include: more
    than half of them (what a majority of the model's answers agree on)."""
    return check_consensus(samples) // 2 + 1


def confidence_text(result: dict) -> str:
    """One line on how sure the model was, from a ``segment`` reply: the consensus's confidence,
    else the answer signal, else ``""`` (a re-propagation, or a worker that sends neither)."""
    conf: Optional[float] = result.get("confidence")
    samples = result.get("samples") or []
    if conf is not None and samples:
        absent = sum(1 for s in samples if s.get("absent"))
        unusable = sum(1 for s in samples if s.get("unusable"))
        extra = "".join([f"; {absent} said not present" if absent else "",
                         f"; {unusable} unusable" if unusable else ""])
        return (f"{float(conf):.2f}: agreement of {len(samples)} answers of the model (mean pairwise Dice{extra}). "
                "The model agreeing with itself, not the chance that it is right.")
    prob = result.get("answer_mean_prob")
    if prob is not None:
        return (f"answer signal {float(prob):.2f} (how peaked the model's choice of answer tokens was); "
                "not the chance that it is right. Use Advanced › Consensus for a confidence.")
    return ""


def confidence_note(result: dict) -> str:
    """:func:`confidence_text` as a line of its own (the status line, a "not found" answer's notes)."""
    text = confidence_text(result)
    if text and result.get("confidence") is not None and result.get("samples"):
        return "confidence " + text
    return text
