"""Off the training thread: the background worker (transport), what a step becomes (`derive`), and the
anomaly rules."""
