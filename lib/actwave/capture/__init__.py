"""Stage 1, capture: load a target (``models``), tokenise ShareGPT or the target's own
regenerated replies (``data``, ``regenerate``), hook one forward pass for all N+1 hidden
states (``forward``) and write them to a verified, resumable store (``store``)."""
