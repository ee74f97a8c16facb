"""The module's Qt side: the panel (:mod:`.panel`), its correction controls and dialogs, and the
in-Slicer self-test (:mod:`.selftest`, which needs no Qt). Nothing is imported here."""
