"""Stage 1: a call's arguments checked once and prepared into the immutable
:class:`.inputs.AttentionInputs` (:mod:`.call`; :mod:`.fast_path` for a repeat), with the packed
metadata (:mod:`.packed_seqs`), per-sequence policies (:mod:`.policies`), declared packed QKV
(:mod:`.packed_qkv`, :mod:`.layouts`) and the argument checks (:mod:`.validation`)."""
