"""The Lightning callbacks, one a file: :mod:`.kl_loss` (``KLLossCallback``: every ``KLPenaltyLoss`` learns its
Trainer, its controller steps), :mod:`.kl_reward` (``KLRewardCallback``: reward shaping), :mod:`.faults` (their
base: controller faults raised where the host reads) and :mod:`.entry_point` (the factory Lightning's entry
point calls for every Trainer). Imports nothing here: the entry point loads this folder for every Trainer."""
