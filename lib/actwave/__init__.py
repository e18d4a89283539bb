"""actwave: which hidden-state layers of an LLM should feed an EAGLE-3 draft.

Reproduces "Surfing the Activation Wave" (information and geometry of hidden states for
speculative decoding). Modules: models, data, capture, store, regenerate, metrics,
analysis, selection, selection_report, eagle3, speculative, tree, evaluate, plots, config.
"""
__version__ = "0.1.0"
