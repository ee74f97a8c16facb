"""The module's logic on MRML, without Qt: the facade :class:`.logic.MedVolR1SlicerLogic` and
the parts it composes (results, markups, views, storage, nodes, parameters). Nothing is imported
here, so a part can be imported alone."""
