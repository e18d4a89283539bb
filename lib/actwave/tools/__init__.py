"""Command-line tools: ``python -m actwave select`` (``cli``), what ``reproduce.sh`` runs
(``runplan``), the per-step cost log (``steplog``) and the check of regenerated tables
against the committed ones (``compare``)."""
