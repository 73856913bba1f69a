"""Context parallelism: TE's contract on torch.distributed (:mod:`.context_parallel`), the ring,
all-gather and a2a schedules (:mod:`.algorithms`), their communication (:mod:`.comm`), the load-
balanced partition (:mod:`.partition`) and the span calls the schedules make (:mod:`.spans`)."""
