"""Stage 2: which backend runs a prepared call. The backends' declarations
(:mod:`.support`), the installed libraries (:mod:`.libraries`), the host facts selection reads
(:mod:`.params`), the choice itself and ``backend_scope`` (:mod:`.backend_selection`), the opt-in
measured choice among the accepting backends (:mod:`.autotune`, ``NVTE_ATTN_AUTOTUNE``), the
report of why (:mod:`.explain`) and TE's spelling of it all (:mod:`.te_compat`)."""
