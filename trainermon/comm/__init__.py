"""Communication monitoring (`cc_distribution`): which collectives are watched and how their arguments
are read (`spec`), where they are called from (`sites`), the temporary patches (`patch`), the step's
accumulated statistics (`accum`) and the invariant checks (`checks`). The probe that drives them is
`trainermon.runtime.probes.comm`. Nothing here imports torch.distributed at module level."""
