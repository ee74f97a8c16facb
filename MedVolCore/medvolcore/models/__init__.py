"""Model presets and their weights (``medvol models``).

- :mod:`.manifest` — the preset table (``Resources/models.json``, ``$MEDVOL_MODELS_JSON``), read
  and checked: :class:`Preset`, :func:`get_preset`, :func:`list_presets`, :func:`default_preset`;
- :mod:`.registration` — where a preset's weights live and what their registration says is there;
- :mod:`.checks` — checking a Qwen3-VL model folder, a LoRA adapter, and an adapter's base model;
- :mod:`.presets` — a preset resolved: :func:`resolve` to local paths, whether its weights are
  present (:func:`preset_status`), the listing (:func:`list_status`); it re-exports the names above;
- :mod:`.fetch` — getting weights onto the machine: :func:`download` from the Hugging Face Hub,
  :func:`import_weights` from a folder copied by hand;
- :mod:`.identity` — what made a result, said honestly (:func:`identity`: zero-shot base model,
  MedVol-R1 adapter, LoRA adapter of unknown training, smoke model);
- :mod:`.tiny` — the untrained ``tiny`` smoke model, built locally (imported only when needed).

Importing this package is cheap: ``huggingface_hub``, torch and transformers are imported only by
the functions that need them, and nothing is downloaded unless :func:`download` is called.
"""

from .fetch import (IMPORT_LAYOUT, ImportLayout, download, find_import_layout, hub_cache_dir, import_layout,
                    import_weights, sha256_file)
from .identity import identity, identity_banner, identity_note
from .presets import (OVERRIDE_ENV, REGISTRATION, REGISTRATION_SCHEMA, SCHEMA, Preset, ResolvedModels,
                      best_available_preset, check_adapter_base, check_adapter_dir, check_adapter_given,
                      check_grounder_dir, check_revision, default_preset, folder_listing, get_preset, list_presets,
                      list_status, medvol_home, models_dir, path, preset_identity, preset_status, read_registration,
                      registration_path, resolve, revisions, weights_dir)

__all__ = [
    "IMPORT_LAYOUT", "OVERRIDE_ENV", "REGISTRATION", "REGISTRATION_SCHEMA", "SCHEMA", "best_available_preset",
    "check_adapter_base", "check_adapter_dir", "check_adapter_given", "check_grounder_dir", "check_revision",
    "default_preset", "download", "find_import_layout", "folder_listing", "get_preset", "hub_cache_dir", "identity",
    "identity_banner", "identity_note", "import_layout", "import_weights", "ImportLayout", "list_presets",
    "list_status", "medvol_home", "models_dir", "path", "Preset", "preset_identity", "preset_status",
    "read_registration", "registration_path", "resolve", "ResolvedModels", "revisions", "sha256_file", "weights_dir"
]
