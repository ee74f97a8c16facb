"""TotalSegmentator v2 label ids the tests use (``class_map_total_v2.json``), importable by name
(``from ts_labels import LIVER``) from any test folder: ``Testing/`` is on ``sys.path``."""

SPLEEN, KIDNEY_RIGHT, KIDNEY_LEFT, GALLBLADDER, LIVER, STOMACH = 1, 2, 3, 4, 5, 6
URINARY_BLADDER = 21
