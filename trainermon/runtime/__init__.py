"""The step loop (`loop`), what each step collects (`plan`), the probes that see tensors (`probes`),
dynamic control (`control`), escalation, parameter and module selection, and this rank's outputs."""
