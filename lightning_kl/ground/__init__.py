"""The ground floor, imported by every layer and importing nothing above it: generic check primitives, the dtype
rule and the warning at the user's line (:mod:`.checks`), the one chunk runner of the chunked kernels
(:mod:`.chunks`), the data parallel group every part reduces over (:mod:`.parallel`), the sampler's settings
(:mod:`.sampler`), vocabulary shards (:mod:`.vocab_shards`) and the vector-math call made at import
(:mod:`.vector_math`)."""
