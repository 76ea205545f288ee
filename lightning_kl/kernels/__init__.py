"""The kernels: chunked :class:`torch.autograd.Function` implementations behind the public functions.

:mod:`.fused` (every sampled-token estimator in one pass each way), :mod:`.full` (the exact KL over the
vocabulary), :mod:`.logprobs` (token log-probs from logits or hidden states); :mod:`.rows` reads
logits by chunks of rows, from a tensor or made from hidden states. They build on
:mod:`lightning_kl.ground` and on the estimator maths, never on the public functions or the shells
above them.
"""
