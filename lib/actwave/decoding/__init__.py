"""Stage 4, decoding: speculative decoding with a trained draft (``speculative``, over the
draft trees of ``tree``), device timing (``timing``), the tree-shape cost model
(``costmodel``), offline acceptance (``acceptance``), the timed evaluation against
plain greedy decoding (``evaluate``) and its statistics and tables (``report``). Imports run
one way: ``speculative`` uses ``tree``; ``costmodel`` uses both and picks a ``TreeShape``
that callers hand to ``speculative.generate``."""
