"""Stage 2, statistics: per-layer matrix entropy and CKA (``metrics``, pure), computed
over a capture store (``analysis``, cached), the layer-selection methods (``selection``),
their comparison tables (``selection_report``) and the wave's sensitivity to the
analysis choices (``sensitivity``)."""
