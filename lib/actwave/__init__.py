"""actwave: which hidden-state layers of an LLM should feed an EAGLE-3 draft.

Reproduces "Surfing the Activation Wave" (information and geometry of hidden states for
speculative decoding). One subpackage per stage, in pipeline order:

- ``capture``  target models, prompt data, hooked forward pass, the hidden-state store
- ``stats``    per-layer entropy and CKA, layer selection and its reports, sensitivity
- ``eagle3``   the draft: config, layers, model, vocabulary, TTT training, engine exports
- ``decoding`` speculative decoding, draft trees, timing, cost model, acceptance, evaluation
               and its report
- ``study``    the layer-set study: runs and records, statistics, report

Shared by every stage: ``config`` (artifact keys, atomic writes), ``integrity``
(verified artifacts, writer locks), ``index`` (notebook hand-over files), ``plots``
(tables, figures, manifests). ``tools``: the ``actwave`` command (``tools.cli``: select,
plan, run, compare, train, bench), ``reproduce.sh``'s runner, step log and ``--compare``.
"""
__version__ = "0.1.0"
