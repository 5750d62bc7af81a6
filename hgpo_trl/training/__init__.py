"""What turns a rollout's steps into TRL's batch and keeps a run going: which steps become samples and in which
micro-batches (`step_batches`), on which process (`balance`), as which tensors (`loss_inputs`); more rollouts when
groups carry no signal (`dynamic_sampling`); the iteration as the unit of the run (`iterations`), its metrics
(`metrics`) and console and plots (`reporting`); checkpoints (`checkpoints`) and stopping on a signal
(`interrupts`)."""
