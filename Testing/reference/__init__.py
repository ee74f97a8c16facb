"""Yardsticks that tests and benchmarks share, imported as ``reference.*`` (pytest puts
``Testing/`` on ``sys.path``; a benchmark script inserts it). They import no benchmark.

- ``medsam2``: the propagation loop written the way MedSAM2's own CT inference script works
  (``reference_propagate``, ``reference_propagate_prompts``), and as a script the whole-process
  counterpart of ``medvol propagate``;
- ``controlled_masks``: a MedSAM2 predictor whose tracked masks follow given volumes while every
  sam2 computation still runs;
- ``qwen3_vl_sizes``: the published Qwen3-VL sizes and the memory a run of each needs;
- ``orthanc``: a real Orthanc with its DICOMweb plugin on a free loopback port (the PACS tests'
  and benchmark's server), or why it cannot run here.
"""
