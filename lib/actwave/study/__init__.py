"""The layer-set study (notebooks 08-10): which sets and one draft per (set, seed) with its
record (``runs``), the statistics over records (``stats``) and their tables and figures
(``report``)."""
