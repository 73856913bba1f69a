"""Context parallelism, entered after preparation and selection: TE's contract and the entry
(:mod:`.context_parallel`: a prepared record, the CP config and the selected backend in), what
each comm type runs (:mod:`.support`), the ring, all-gather and a2a schedules (:mod:`.algorithms`),
their communication (:mod:`.comm`), the load-balanced partition (:mod:`.partition`) and the span
calls the schedules make over the backend's kernel interface (:mod:`.spans`). Imports run from
here to ``backends/``, never back, and nothing here imports the module."""
