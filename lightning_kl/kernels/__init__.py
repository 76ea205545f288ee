"""The kernels: chunked :class:`torch.autograd.Function` implementations behind the public functions.

:mod:`.engine` (the one vocabulary engine: token log-probs, the exact KL and the entropy, from logits
or hidden states, over the whole vocabulary or a shard of it, with an optional sampler), :mod:`.full`
(logits, shards and heads resolved to the engine's sources and partitions), :mod:`.processing` (the
sampler's kept set, as ``generate`` chooses it), :mod:`.fused` (every sampled-token estimator in one
pass each way). They build on :mod:`lightning_kl.ground` and on the estimator maths, never on the
public functions or the shells above them.
"""
