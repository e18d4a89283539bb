"""Stage 4, decoding: speculative decoding with a trained draft (``speculative``, over the
draft trees of ``tree``), device timing (``timing``), the tree-shape cost model
(``costmodel``), offline acceptance (``acceptance``) and the timed evaluation against
plain greedy decoding (``evaluate``)."""
