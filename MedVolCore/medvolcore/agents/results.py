"""What ``medvol mcp``'s tools return, as Pydantic models: the SDK publishes their JSON Schema as
each tool's ``outputSchema`` and checks every result against it.

The field descriptions are written for a language model that reads the schema. Coordinates
follow ``docs/architecture.md``: slice indices are 0-based on the canonical axial stack (head to
feet), boxes are inclusive pixel ranges ``[x0, y0, x1, y1]`` on that slice (x: patient right to
left, y: anterior to posterior), millimetres are RAS world coordinates. Built from the worker's
reply (:meth:`medvolcore.result.SegmentResult.to_wire`) without reshaping what it means.
"""

from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import BaseModel, Field

__all__ = ["Box", "KeySlice", "OutputFile", "Target", "SegmentOutcome", "VolumeInfo", "SeriesEntry", "SeriesList",
           "JobState"]


class Box(BaseModel):
    """One box of the evidence anchor on the key slice."""

    voxels: List[int] = Field(description="[x0, y0, x1, y1]: inclusive pixel ranges on the key axial slice")
    ras_mm: Optional[List[List[float]]] = Field(
        None, description="the RAS millimetre centres of the box's first and last voxel: [[r, a, s], [r, a, s]]")


class KeySlice(BaseModel):
    """The axial slice the model chose as evidence."""

    index: int = Field(description="0-based index on the canonical axial stack (0 = most superior slice)")
    s_mm: Optional[float] = Field(None, description="its superior-inferior position in millimetres (RAS S)")


class OutputFile(BaseModel):
    """A file the server wrote; read it by its path (same machine) or as an MCP resource (its uri)."""

    kind: Literal["mask", "seg_nrrd", "dicom_seg", "anchor", "qc", "labels"] = Field(
        description="mask: uint8 label map (.nii.gz) on the CT's own grid; seg_nrrd: the same voxels as a 3D Slicer "
                    "segmentation; dicom_seg: the same as a DICOM Segmentation referencing the source series; anchor: the evidence anchor (JSON); qc: the QC picture (PNG); labels: the label "
                    "table of several targets")
    path: str = Field(description="absolute path on the server's machine")
    uri: str = Field(description="MCP resource URI serving the same bytes")
    target: Optional[int] = Field(None, description="the target (label value) this file belongs to, when one")


class Target(BaseModel):
    """One query's answer."""

    label: int = Field(description="its label value in the mask (k for the k-th query)")
    query: str
    found: bool = Field(description="False when the model answered that the structure is not in this CT")
    structure: Optional[str] = Field(None, description="the structure the query was matched to (by its words, never "
                                                       "by the model), e.g. 'liver'")
    code: Optional[str] = Field(None, description="its SNOMED CT code as SCHEME:VALUE (e.g. SCT:10200004); the "
                                                  "generic anatomical-structure code when the words matched none")
    code_meaning: Optional[str] = Field(None, description="what the code means, e.g. 'Liver'")
    key_slice: Optional[KeySlice] = Field(None, description="the evidence slice; null when not found")
    boxes: List[Box] = Field(default_factory=list, description="the evidence boxes on the key slice")
    volume_ml: Optional[float] = Field(None, description="the mask's volume in millilitres")
    voxels: Optional[int] = Field(None, description="the mask's voxel count")
    hu: Optional[dict] = Field(None, description="Hounsfield units inside the mask: mean, std, min, max")
    bbox_ras_mm: Optional[List[List[float]]] = Field(None, description="the mask's bounding box: [[r, a, s] min, "
                                                                       "[r, a, s] max] in millimetres")
    confidence: Optional[float] = Field(
        None, description="with a consensus (consensus >= 2): how much the model's samples agree, 0..1; agreement of "
                          "one model with itself, not the probability of being right")
    answer_mean_prob: Optional[float] = Field(
        None, description="how peaked the model's token choices were (0..1); not a probability of being right")
    reasoning: str = Field("", description="the model's own reasoning text, as it wrote it")
    notes: List[str] = Field(default_factory=list, description="remarks the reader must see (smoke model, zero-shot "
                                                               "model, plausibility, reordered boxes, …)")


class SegmentOutcome(BaseModel):
    """The result of segment_from_query or repropagate."""

    job: str = Field(description="this result's id: give it to repropagate to correct it, or to job_status")
    status: Literal["segmented", "not_found"] = Field(
        description="segmented: at least one target has a mask; not_found: the model answered that no queried "
                    "structure is in this CT (an answer, not an error; see the notes before trusting it)")
    volume: str = Field(description="the volume as given")
    model: str = Field(description="which model answered (e.g. zero-shot base model, MedVol-R1 adapter, smoke model)")
    smoke: bool = Field(description="True for the untrained tiny smoke model: every answer is meaningless")
    targets: List[Target]
    files: List[OutputFile]
    slices_encoded: int = Field(description="slices MedSAM2 had to encode for this call (0 when all were kept from "
                                            "an earlier call on the same volume)")
    seconds: float = Field(description="time the job took on the server")
    notes: List[str] = Field(default_factory=list)
    research_use: str = Field(description="the research-use notice every result carries")


class VolumeInfo(BaseModel):
    """What describe_volume reads from a volume's header and voxels (what `medvol info` says)."""

    volume: str
    format: str
    shape: List[int] = Field(description="voxels along the file's own axes")
    spacing_mm: List[float]
    orientation: str = Field(description="the file's axis codes (e.g. LPS)")
    axial_slices: int = Field(description="slices of the canonical axial stack (valid key_slice indices are "
                                          "0..axial_slices-1)")
    slice_size: List[int] = Field(description="[width, height] of an axial slice in pixels (box coordinates)")
    hu_range: List[float] = Field(description="lowest and highest voxel value")
    ct_like: bool = Field(description="whether the intensities look like CT Hounsfield units")
    notes: List[str] = Field(default_factory=list)


class SeriesEntry(BaseModel):
    url: str = Field(description="the series URL to give segment_from_query as volume")
    study: str
    series: str


class SeriesList(BaseModel):
    """The series list_series found (at most limit; more may exist)."""

    server: str
    series: List[SeriesEntry]
    truncated: bool = Field(description="True when the limit was reached: narrow the filters for the rest")


class JobState(BaseModel):
    """Where a job of this session stands."""

    job: str
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    stage: Optional[str] = Field(None, description="read, load, ground, propagate or write while running")
    fraction: Optional[float] = Field(None, description="the stage's fraction of work done, 0..1")
    message: str = ""
    result: Optional[SegmentOutcome] = Field(None, description="the result once done")
