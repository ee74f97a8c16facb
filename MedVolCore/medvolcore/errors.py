"""One exception family for the whole engine.

Every message says what was wrong and, where it helps, what to do. The CLI prints
``str(error)`` as a single line and exits non-zero; the worker turns it into a JSON
error reply whose ``code`` is the class's ``code``.
"""

from __future__ import annotations


class MedVolError(Exception):
    """Base class of every error the engine raises on purpose."""

    code = "medvol_error"
    exit_code = 2


class InputError(MedVolError):
    """A user-supplied argument or value is wrong (a slice, a box, a label, an option)."""

    code = "bad_input"


class FieldError(InputError):
    """A request's field, or fields together, break a rule of the request's declaration
    (:mod:`medvolcore.request`): a missing or mistyped field, a value outside its limits, fields
    that do not go together. The message names each field as the door that built the request calls
    it (``--consensus``, ``'consensus'``). The worker answers it as ``bad_request`` (text that is not
    valid Unicode: ``bad_input``)."""

    code = "bad_request"

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        if code:
            self.code = code


class VolumeError(MedVolError):
    """A volume or label map cannot be read or is not a 3-D numeric image."""

    code = "bad_volume"


class GroundTruthError(VolumeError):
    """A ground truth (reference label map) that cannot score the case: unreadable, of another space,
    or without the requested label."""

    code = "bad_ground_truth"


class AnchorError(MedVolError):
    """An evidence anchor (object or file) is malformed or inconsistent."""

    code = "bad_anchor"


class AnswerFormatError(MedVolError):
    """A model answer does not follow the ``<think>…</think><answer>[…]</answer>`` format."""

    code = "bad_answer"


class CheckpointError(MedVolError):
    """A model checkpoint is missing, unreadable or not the expected kind."""

    code = "bad_checkpoint"


class ModelNotFoundError(MedVolError):
    """A model preset or its weights are not available locally."""

    code = "model_not_found"


class AdapterRequiredError(InputError):
    """A preset that names a trained method (``medvol-r1``) was asked for without its LoRA adapter:
    without one it would be the untrained base model under the method's name."""

    code = "adapter_required"


class DependencyError(MedVolError):
    """An optional dependency needed for this operation is not installed."""

    code = "missing_dependency"


class OutputExistsError(MedVolError):
    """An output path exists and overwriting was not requested."""

    code = "output_exists"


class OutputError(MedVolError):
    """An output cannot be written there (permission, a file where a folder should be, a full
    disk, a format the writer does not know, two outputs that are one file)."""

    code = "bad_output"


class ForbiddenError(MedVolError):
    """A remote client named a server path it may not use (outside ``--data-dir``, or any
    path when the operator allowed none)."""

    code = "forbidden"


class LimitError(MedVolError):
    """An input is over a limit set to protect the machine (voxels, files in a folder, boxes)."""

    code = "too_large"


class CancelledError(MedVolError):
    """The operation was cancelled by the caller."""

    code = "cancelled"
    exit_code = 130


class ModelError(MedVolError):
    """A model folder or adapter is not what was expected (wrong architecture, wrong base model)."""

    code = "bad_model"


class AdapterMismatchError(ModelError):
    """A LoRA adapter whose ``medvol_adapter.json`` names another base model than the preset's
    (trained on Qwen3-VL-2B, used with the 4B; trained on the tiny smoke model, used with a real one)."""

    code = "adapter_mismatch"


class GenerationError(MedVolError):
    """The language model never produced a usable answer (the message includes the raw text).

    Not the user's input: the CLI exits with a code distinct from bad input.
    """

    code = "generation_failed"
    exit_code = 3


def shown(value, limit: int = 60) -> str:
    """``value`` as an error message quotes it: its ``repr`` cut to ``limit`` characters, so a
    400-digit number or a megabyte string sent by a client never fills an error line."""
    try:
        text = repr(value)
    except ValueError:  # an int over Python's digit limit for str()
        return "a number too long to show"
    return text if len(text) <= limit else text[: limit - 1] + "…"
