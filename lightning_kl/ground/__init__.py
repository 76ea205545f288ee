"""The ground floor: input checks and dtype rules (:mod:`.checks`), and the one chunk runner that every
chunked kernel uses (:mod:`.chunks`). It imports nothing else of the package."""
